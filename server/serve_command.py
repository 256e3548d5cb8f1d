"""``splitfuse serve [MODEL] ...``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

# flag dest -> config field (server level or engine level; see server.config).
_FLAG_FIELDS = (
    "host",
    "port",
    "served_model_name",
    "max_queued_requests",
    "max_sequences_per_request",
    "max_body_bytes",
    "api_key",
    "api_key_file",
    "drain_timeout",
    "log_level",
    "metrics_require_auth",
    "vllm_metrics",
    "tenant_header",
    "model",
    "tokenizer",
    "dtype",
    "kv_cache_dtype",
    "device",
    "max_batch_tokens",
    "max_batch_seqs",
    "max_model_len",
    "block_size",
    "kv_cache_memory",
    "num_kv_blocks",
    "enable_prefix_caching",
    "tensor_parallel_size",
    "attention_backend",
    "seed",
    "num_threads",
    "compile",
    "quantization",
    "scheduling_policy",
    "fair_share",
    "deterministic",
    "num_scheduler_steps",
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve MODEL (a model folder, a GGUF file or a prepared model's name; default: the "
            "default model, prepared on first use). Settings come from flags, then SPLITFUSE_* "
            "environment variables, then --config FILE, then defaults."
        ),
    )
    add = parser.add_argument
    add("model", nargs="?", default=None, metavar="MODEL", help="model folder or name")
    add("--config", metavar="FILE", help="a YAML or JSON config file")
    server = parser.add_argument_group("server")
    server.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    server.add_argument("--port", type=int, help="port (default 8000)")
    server.add_argument("--served-model-name", help="the model name clients send")
    server.add_argument(
        "--max-queued-requests",
        type=int,
        help="sequences (prompts x n) waiting for a first token before 429 (256)",
    )
    server.add_argument(
        "--max-sequences-per-request",
        type=int,
        help="prompts x n one request may ask for; more get 400 (128)",
    )
    server.add_argument("--max-body-bytes", help="413 above this body size (e.g. 1MiB)")
    server.add_argument(
        "--api-key", action="append", help="an accepted API key (repeatable)", default=None
    )
    server.add_argument("--api-key-file", help="a file of API keys, one per line")
    server.add_argument(
        "--drain-timeout", type=float, help="seconds in-flight requests get on SIGTERM (30)"
    )
    server.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    server.add_argument(
        "--metrics-require-auth",
        action="store_const",
        const=True,
        help="require the API key for /metrics too",
    )
    server.add_argument(
        "--no-vllm-metrics",
        dest="vllm_metrics",
        action="store_const",
        const=False,
        help="export only the splitfuse_* metrics, not the vllm:* series gateways read",
    )
    server.add_argument(
        "--tenant-header",
        metavar="NAME",
        help="a header naming each request's tenant, set by a trusted gateway (default: the "
        "API key is the tenant)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--tokenizer", help="tokenizer folder (default: the model's)")
    engine.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "bfloat16", "float16", "fp8", "float8_e4m3fn"],
        help="the KV cache's dtype (auto: the model's, float16 for quantized weights with "
        "float32 activations on a CPU; fp8: float8 e4m3fn, unscaled, +-448 at most)",
    )
    engine.add_argument("--device", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--max-batch-tokens", type=int, help="token budget per step (512)")
    engine.add_argument("--max-batch-seqs", type=int, help="rows per step (128)")
    engine.add_argument("--max-model-len", type=int, help="context length (the model's)")
    engine.add_argument("--block-size", type=int, help="tokens per KV block (16)")
    engine.add_argument(
        "--kv-cache-memory", help="KV cache size ('4GiB') or a fraction of free memory (0.3)"
    )
    engine.add_argument("--num-kv-blocks", type=int, help="override the sized block count")
    engine.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_const",
        const=False,
        help="disable prefix caching",
    )
    engine.add_argument(
        "--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int, help="ranks"
    )
    engine.add_argument("--attention-backend", choices=["auto", "torch", "triton"])
    engine.add_argument("--seed", type=int, help="engine seed")
    engine.add_argument("--num-threads", type=int, help="CPU threads (default: all cores)")
    engine.add_argument(
        "--quantization",
        choices=["none", "auto", "int8", "int4"],
        help="weight-only quantization (default: auto, int4 on a CPU that runs the quantized "
        "product natively; a GGUF model keeps its own 4- and 8-bit blocks); group sizes and "
        "DeepSpeed's quant form go in --config",
    )
    engine.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        help="fcfs (default), or priority: the requests' priority (lower first), then arrival",
    )
    engine.add_argument(
        "--fair-share",
        action="store_const",
        const=True,
        help="share each step's prompt-token budget between tenants",
    )
    engine.add_argument(
        "--deterministic",
        action="store_const",
        const=True,
        help="bitwise-identical tokens and logprobs for a request whatever else runs (slower; "
        "start-up waits for the compiled graph; see the README)",
    )
    engine.add_argument(
        "--num-scheduler-steps",
        type=int,
        help="decode steps a batch of plain greedy, not streamed decodes runs per scheduling "
        "pass (default: 4 where the CPU decode stack holds the 8-bit LM head, else 1)",
    )
    engine.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the step graphs in the background while serving eagerly (default: on; "
        "CPU, torch attention backend, one process; under a minute for the default model on 2 "
        "cores, then every step shape runs compiled); on a GPU, capture CUDA graphs of decode "
        "steps at start-up",
    )
    parser.set_defaults(func=run)


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line (None = not given)."""
    values = {name: getattr(args, name, None) for name in _FLAG_FIELDS}
    return {name: value for name, value in values.items() if value is not None}


def run(args: argparse.Namespace) -> int:
    from server.config import ConfigError, load_config

    try:
        config = load_config(flags_from_args(args), config_file=args.config)
    except ConfigError as error:
        print(f"splitfuse serve: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from engine.device import leave_triton_unloaded

    leave_triton_unloaded(config.engine.device, config.engine.attention_backend)
    from engine.tensor_parallel.distributed import torchrun_environment

    torchrun = torchrun_environment()
    if torchrun is not None and torchrun.rank != 0:
        # a tensor-parallel rank started by torchrun: no HTTP server, it serves rank 0's steps
        from engine.tensor_parallel.worker import run_torchrun_worker

        return run_torchrun_worker(config.engine)
    from server.app import create_app, describe_config
    from server.runner import run as run_server

    logging.getLogger("splitfuse.server").info("config %s", describe_config(config))
    app = create_app(config)
    return run_server(app, config.host, config.port, config.log_level)
