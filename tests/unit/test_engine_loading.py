"""Model folders: config parsing, safetensors loading (single, sharded), refusals, device/dtype
choices, KV-cache sizing and model-name resolution."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import engine.device as device_module
import engine.kv_cache_memory as kv_memory
import engine.model_resolver as resolver
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig, ModelConfigError
from engine.weights import WeightsError, safetensors_files
from scheduler.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


# -- config.json ----------------------------------------------------------------------------


def test_config_reads_both_rope_layouts() -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 5e5, **llama3}})
    old = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": llama3})
    assert new.rope_theta == old.rope_theta == 5e5
    assert new.rope_scaling == old.rope_scaling == llama3
    legacy = ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0
    assert plain.head_dim == 16


def test_config_fields_and_eos_ids() -> None:
    qwen = ModelConfig.from_dict(
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "eos_token_id": [5, 6], "head_dim": 32},
        {"eos_token_id": 7},
    )
    assert qwen.attention_bias and qwen.head_dim == 32
    assert qwen.eos_token_ids == (5, 6, 7)
    assert not ModelConfig.from_dict(BASE).attention_bias


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "LlamaForCausalLM, MistralForCausalLM, Qwen2"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_config_errors_are_clear(change, message) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({**BASE, **change})


def test_unknown_architecture_folder_fails_before_loading(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["FooLM"]}))
    with pytest.raises(ModelConfigError, match="supported: LlamaForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=8))


# -- weights --------------------------------------------------------------------------------


def test_pickled_checkpoints_are_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(WeightsError, match="refused because unpickling"):
        safetensors_files(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        safetensors_files(empty)


def _greedy(model_dir: Path, prompt: list[int], **config) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32, **config))
    from scheduler.sampling_params import SamplingParams

    engine.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.extend(delta.new_token_ids)
    return tokens


def test_sharded_checkpoint_loads_like_single_file(tiny_llama_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 1
    prompt = [5, 6, 7, 8, 9]
    assert _greedy(sharded, prompt, dtype="float32") == _greedy(
        tiny_llama_dir, prompt, dtype="float32"
    )


def _copy_model(source: Path, target: Path, edit) -> Path:
    from safetensors.torch import load_file

    target.mkdir()
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (target / path.name).write_bytes(path.read_bytes())
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def test_missing_and_misshapen_weights_are_clear_errors(tiny_llama_dir, tmp_path) -> None:
    missing = _copy_model(
        tiny_llama_dir, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")
    )
    with pytest.raises(ValueError, match="missing from the checkpoint: model.layers.1.mlp.gate_up"):
        LLMEngine(EngineConfig(model=str(missing), dtype="float32", num_kv_blocks=8))

    def shrink(tensors: dict) -> None:
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()

    misshapen = _copy_model(tiny_llama_dir, tmp_path / "misshapen", shrink)
    with pytest.raises(ValueError, match=r"model.norm.weight: .*checkpoint shape \(10,\)"):
        LLMEngine(EngineConfig(model=str(misshapen), dtype="float32", num_kv_blocks=8))


def test_bfloat16_load_runs(tiny_qwen2_dir) -> None:
    tokens = _greedy(tiny_qwen2_dir, [3, 4, 5], dtype="bfloat16")
    assert len(tokens) == 8


# -- device, dtype, backend -----------------------------------------------------------------


def test_auto_dtype_is_bfloat16_where_the_cpu_runs_it(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(device_module, "cpu_runs_bf16", lambda: True)
    assert device_module.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(device_module, "cpu_runs_bf16", lambda: False)
    assert device_module.resolve_dtype("auto", cpu) == torch.float32
    assert device_module.resolve_dtype("float16", cpu) == torch.float16
    assert device_module.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_kv_cache_dtype_auto_is_float16_for_float32_activations_over_quantized_weights():
    resolve = device_module.resolve_kv_cache_dtype
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve("auto", torch.float32, cpu, "torch", quantized=True) == torch.float16
    assert resolve("auto", torch.float32, cpu, "torch", quantized=False) == torch.float32
    assert resolve("auto", torch.bfloat16, cpu, "torch", quantized=True) == torch.bfloat16
    assert resolve("auto", torch.float16, cpu, "torch", quantized=True) == torch.float16
    assert resolve("auto", torch.float32, cuda, "triton", quantized=True) == torch.float32
    assert resolve("auto", torch.float32, cpu, "triton", quantized=True) == torch.float32
    assert resolve("float32", torch.float32, cpu, "torch", quantized=True) == torch.float32
    assert resolve("float16", torch.float32, cpu, "torch", quantized=False) == torch.float16
    assert resolve("bfloat16", torch.bfloat16, cuda, "triton", quantized=False) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype float32 with bfloat16 .* torch attention"):
        resolve("float32", torch.bfloat16, cuda, "triton", quantized=False)
    f8 = torch.float8_e4m3fn
    assert resolve("fp8", torch.bfloat16, cpu, "torch", quantized=True) == f8
    assert resolve("float8_e4m3fn", torch.float32, cuda, "torch", quantized=False) == f8
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 with bfloat16 .* torch attention"):
        resolve("fp8", torch.bfloat16, cuda, "triton", quantized=False)


def test_the_engine_allocates_its_cache_in_the_kv_cache_dtype(tiny_llama_dir, caplog) -> None:
    """A cache of its own dtype is sized by its own element size, named in the start-up log
    and the resolved config, and serves: greedy tokens of a prompt in two chunks and decodes
    agree with a float32 cache's for 16-bit caches (the tiny model's logits spread far wider
    than bfloat16 K/V move them)."""
    caplog.set_level(logging.INFO, logger="engine.model_runner")
    tokens = {}
    for cache_dtype in ("float32", "bfloat16", "float16", "float8_e4m3fn"):
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir), dtype="float32", kv_cache_dtype=cache_dtype,
                kv_cache_memory="1MiB", max_batch_tokens=8,
            )
        )  # fmt: skip
        assert engine.config.kv_cache_dtype == cache_dtype
        assert engine.runner.kv_cache.dtype == getattr(torch, cache_dtype)
        # 2 layers x 2 x 16 tokens x 2 KV heads x 16 x element size per block
        element_size = {"float32": 4, "float8_e4m3fn": 1}.get(cache_dtype, 2)
        assert engine.num_kv_blocks == 2**20 // (2 * 2 * 16 * 2 * 16 * element_size)
        assert f"tokens, {cache_dtype}," in caplog.text
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("r", list(range(3, 16)), params)  # 13 tokens: chunks of 8 and 5
        out: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                out.extend(output.new_token_ids)
        tokens[cache_dtype] = out
    assert tokens["bfloat16"] == tokens["float16"] == tokens["float32"]
    # float8 moves K/V by up to 2^-4 of their value: the tiny model's tokens part from the others
    # after a few (its kernels are checked against the same numbers in wider caches instead)
    assert len(tokens["float8_e4m3fn"]) == 6


def test_a_float8_cache_warns_where_k_or_v_reach_its_largest_value(tiny_llama_dir, caplog):
    """A float8 cache stores K/V beyond +-448 as +-448: the engine looks at its first tokens'
    bytes and warns once, naming the layers, where a model's K/V got there (layer 1's input
    norm scaled up here); a model well inside the range logs nothing, and a 16-bit cache is
    never looked at."""
    caplog.set_level(logging.WARNING, logger="engine.kv_cache_memory")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def serve(engine: LLMEngine) -> None:
        engine.add_request("r", list(range(3, 40)), params)
        while engine.has_unfinished_requests():
            engine.step()

    def engine_with(cache_dtype: str) -> LLMEngine:
        return LLMEngine(
            EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_dtype=cache_dtype,
                         num_kv_blocks=16)
        )  # fmt: skip

    plain = engine_with("fp8")
    serve(plain)
    assert plain.runner.float8_watch.layers == [] and "float8 KV cache" not in caplog.text
    assert plain.runner.float8_watch.left == kv_memory.FLOAT8_WATCH_TOKENS - 39  # 37 + 2 decoded
    assert engine_with("bfloat16").runner.float8_watch.left == 0

    loud = engine_with("fp8")
    with torch.no_grad():
        loud.runner.model.model.layers[1].input_layernorm.weight.mul_(1e4)
    serve(loud)
    assert loud.runner.float8_watch.layers == [1]
    assert loud.runner.float8_watch.left == 0
    assert caplog.text.count("float8 KV cache stored K/V of layer(s) 1 at +-448") == 1


def test_the_kv_cache_dtype_follows_the_weights_under_auto(tiny_llama_dir) -> None:
    quantized = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=8,
                     quantization="int8")
    )  # fmt: skip
    assert quantized.config.kv_cache_dtype == "float16"
    assert quantized.runner.kv_cache.dtype == torch.float16
    plain = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=8))
    assert plain.config.kv_cache_dtype == "float32"


def test_bfloat16_hardware_needs_the_cpu_flags(monkeypatch) -> None:
    monkeypatch.setattr(device_module, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    device_module.cpu_runs_bf16.cache_clear()
    try:
        assert not device_module.cpu_runs_bf16()
    finally:
        device_module.cpu_runs_bf16.cache_clear()


def test_bfloat16_runs_where_onednn_refuses_to_pack_it(tiny_llama_dir) -> None:
    """An AVX2-only CPU, as oneDNN sees it (its ISA capped): ``auto`` picks float32, and a
    bfloat16 model asked for anyway loads and runs with unpacked weights instead of failing."""
    script = (
        "import torch\n"
        "from engine.device import cpu_runs_bf16, resolve_dtype\n"
        "from engine.packed_linear import can_pack\n"
        "from engine import LLM\n"
        "from scheduler.sampling_params import SamplingParams\n"
        "assert not cpu_runs_bf16()\n"
        "assert resolve_dtype('auto', torch.device('cpu')) == torch.float32\n"
        "assert not can_pack(torch.zeros(4, 4, dtype=torch.bfloat16))\n"
        f"llm = LLM(model={str(tiny_llama_dir)!r}, dtype='bfloat16')\n"
        "out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4))\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert device_module.resolve_attention_backend("auto", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert device_module.resolve_attention_backend("triton", cpu) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        device_module.resolve_attention_backend("triton", cpu)


def test_a_cpu_server_leaves_triton_unloaded_and_still_compiles(tmp_path) -> None:
    """Serving on a CPU with the torch backend keeps the Triton package out of the process
    (torch's compiler would load it, ~67 MiB, though nothing runs it), and torch.compile still
    makes C++ code there; a GPU or the Triton backend keeps it; once loaded, it stays."""
    script = (
        "import sys, torch\n"
        "from engine.device import leave_triton_unloaded\n"
        "assert not leave_triton_unloaded('cpu', 'triton')\n"
        "assert 'triton' not in sys.modules\n"
        "assert leave_triton_unloaded('cpu', 'auto')\n"
        "assert not leave_triton_unloaded('cpu', 'auto')\n"
        "f = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1)\n"
        "x = torch.randn(64)\n"
        "torch.testing.assert_close(f(x), torch.nn.functional.silu(x) * 2 + 1)\n"
        "assert sys.modules['triton'] is None\n"
        "assert 'libtriton' not in open('/proc/self/maps').read()\n"
    )
    # a cache of its own: torch's default one is shared by every process of the user, and its
    # keys leave out ATEN_CPU_CAPABILITY, so code compiled for AVX-512 is found and run (wrong
    # numbers) by a process capped at AVX2; the engine keeps its caches per CPU kind itself
    # (test_compiled_code_is_named_by_the_cpu_it_runs_on)
    env = {**os.environ, "TRITON_INTERPRET": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_an_eager_engine_leaves_the_compiler_unimported(tiny_llama_dir) -> None:
    """An engine that does not compile (``compile=False``, ``--no-compile``) never imports
    torch's compiler nor the symbolic shapes it traces with: inductor and dynamo alone cost ~25
    MiB resident, sympy and the symbolic shapes ~35 MiB, for nothing such an engine runs."""
    script = (
        "import sys\n"
        "from engine import LLM\n"
        "from scheduler.sampling_params import SamplingParams\n"
        f"llm = LLM(model={str(tiny_llama_dir)!r}, compile=False)\n"
        "out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3))\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "compiler = ('torch._inductor', 'torch._dynamo', 'sympy')\n"
        "loaded = [name for name in compiler if name in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_compiled_code_is_named_by_the_cpu_it_runs_on(monkeypatch) -> None:
    """Compiler caches are kept per CPU kind: another set of CPU flags or another vector
    capability (``ATEN_CPU_CAPABILITY``) names another folder."""
    tag = device_module.cpu_code_tag()
    assert tag.startswith(
        f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability().lower()}-"
    )
    monkeypatch.setattr(device_module, "cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    other_flags = device_module.cpu_code_tag()
    assert other_flags != tag
    monkeypatch.setattr(device_module, "cpu_flags", lambda: frozenset({"avx2", "sse2"}))
    assert device_module.cpu_code_tag() == other_flags  # the flags' order does not matter
    script = "from engine.device import cpu_code_tag\nprint(cpu_code_tag())\n"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    capped = result.stdout.strip()
    assert capped.startswith(f"{platform.machine()}-default-")
    assert (capped == tag) == ("-default-" in tag)


# -- KV-cache sizing ------------------------------------------------------------------------


def test_kv_blocks_from_bytes_or_fraction(monkeypatch) -> None:
    cpu = torch.device("cpu")
    block = kv_memory.bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert block == 368_640
    assert kv_memory.num_blocks_for_budget(2**30, block, cpu, 10**6) == 2912
    monkeypatch.setattr(kv_memory, "free_memory_bytes", lambda device: 10 * block)
    assert kv_memory.num_blocks_for_budget(0.5, block, cpu, 10**6) == 5
    assert kv_memory.num_blocks_for_budget(2**30, block, cpu, 100) == 100  # capped
    with pytest.raises(ValueError, match="holds no block"):
        kv_memory.num_blocks_for_budget(1000, block, cpu, 100)


def test_kv_cache_is_zeroed_and_shaped() -> None:
    cache = kv_memory.allocate_kv_cache(2, 5, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (2, 2, 5, 4, 2, 8) and cache.dtype == torch.bfloat16
    assert not cache.any()
    cache[1, 0, 4] = 1.0  # writable
    assert cache.sum().item() == 4 * 2 * 8


def test_engine_sizes_the_cache_from_memory_and_logs_it(tiny_llama_dir, caplog) -> None:
    caplog.set_level(logging.INFO, logger="engine.model_runner")
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="1MiB")
    )
    # 2 layers x 2 x 16 tokens x 2 KV heads x 16 x 4 bytes = 8 KiB per block
    assert engine.num_kv_blocks == 128
    assert engine.runner.kv_cache.shape == (2, 2, 128, 16, 2, 16)
    assert "KV cache: 128 blocks of 16 tokens" in caplog.text
    assert engine.config.dtype == "float32" and engine.config.max_model_len == 1024
    assert engine.model_name == tiny_llama_dir.name


def test_max_model_len_above_the_model_is_refused(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=4096, num_kv_blocks=8))


# -- model names ----------------------------------------------------------------------------


def test_resolve_model_paths_and_names(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPLITFUSE_CACHE", str(tmp_path / "cache"))
    assert resolver.resolve_model(str(tiny_llama_dir)) == tiny_llama_dir.resolve()
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        resolver.resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model 'no-such-model' not found"):
        resolver.resolve_model("no-such-model")
    named = tmp_path / "cache" / "models" / "mine"
    named.mkdir(parents=True)
    (named / "config.json").write_text("{}")
    assert resolver.resolve_model("mine") == named


def test_prepare_is_idempotent_and_atomic(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPLITFUSE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def fake_convert(source: Path, out_dir: Path, *, progress: bool) -> None:
        calls.append(out_dir)
        assert out_dir.parent == tmp_path / "cache" / "models"  # staged beside the target
        assert ".tmp-" in out_dir.name
        (out_dir / "config.json").write_text(json.dumps({"n": len(calls)}))

    monkeypatch.setattr(resolver, "convert_gguf", fake_convert)
    monkeypatch.setattr(resolver, "write_quantized_file", lambda source, out_dir: False)
    target = resolver.prepare_model(gguf)
    assert target == tmp_path / "cache" / "models" / DEFAULT_MODEL
    assert resolver.prepare_model(gguf) == target and len(calls) == 1
    assert resolver.resolve_model(DEFAULT_MODEL) == target and len(calls) == 1
    resolver.prepare_model(gguf, force=True)
    assert json.loads((target / "config.json").read_text()) == {"n": 2}
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith(".") and p.is_dir()]
    assert leftovers == []

    def failing_convert(source: Path, out_dir: Path, *, progress: bool) -> None:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(resolver, "convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        resolver.prepare_model(gguf, name="other")
    assert not (target.parent / "other").exists()
    assert [p for p in target.parent.iterdir() if p.is_dir() and ".tmp-" in p.name] == []
    # a .gguf path resolves to a folder prepared under the file's stem
    monkeypatch.setattr(resolver, "convert_gguf", fake_convert)
    assert resolver.resolve_model(str(gguf)) == target.parent / "model"


def test_sliding_window_limits_the_context() -> None:
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    assert ModelConfig.from_dict({**mistral, "sliding_window": 4096}).max_context_len == 4096
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).max_context_len == 32768
    qwen = {**mistral, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).max_context_len == 32768
