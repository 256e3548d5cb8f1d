"""``splitfuse generate "PROMPT" [--chat] [MODEL]``: generate offline and stream the text to stdout.

Only the generated text goes to stdout; logs and progress go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for one prompt, without a server",
        description=(
            "Generate a continuation of PROMPT with MODEL (a model folder or name; default: the "
            "default model, prepared on first use) and stream it to stdout."
        ),
    )
    add = parser.add_argument
    add("prompt", metavar="PROMPT", help="the prompt text")
    add("model", nargs="?", default=None, metavar="MODEL", help="model folder or name")
    add("--chat", action="store_true", help="wrap PROMPT as a user message in the chat template")
    add("--system", metavar="TEXT", help="a system message (with --chat)")
    add("--max-tokens", type=int, default=256, metavar="N", help="tokens to generate (256)")
    add("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default)")
    add("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (1.0: off)")
    add("--seed", type=int, default=None, help="seed of the sampling")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add("--num-threads", type=int, default=None, metavar="N", help="CPU threads")
    add(
        "--compile",
        action="store_true",
        help="compile the step graphs first (about a minute for the default model on 2 cores; "
        "pays off for long outputs)",
    )
    add("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as error:
        print(f"splitfuse generate: error: {error}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from engine.config import DEFAULT_MODEL, EngineConfig
    from engine.detokenizer import SequenceText, StopStrings
    from engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    config = EngineConfig(
        model=args.model or DEFAULT_MODEL,
        dtype=args.dtype,
        num_threads=args.num_threads,
        compile=args.compile,
    )
    engine = LLMEngine(config)
    engine.wait_until_compiled()
    tokenizer = engine.tokenizer
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if len(prompt_ids) + 1 > engine.max_model_len:
        raise ValueError(f"the prompt ({len(prompt_ids)} tokens) does not fit max_model_len")
    max_tokens = min(args.max_tokens, engine.max_model_len - len(prompt_ids))
    if max_tokens != params.max_tokens:
        params = dataclasses.replace(params, max_tokens=max_tokens)
    engine.add_request("generate", prompt_ids, params, streamed=True)  # printed as it comes

    # incremental, as the server detokenizes: a character split across tokens is printed whole
    text = SequenceText(tokenizer, prompt_ids, StopStrings(()))
    error = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            error = delta.error or error
            piece = text.add(delta.new_token_ids, finished=delta.finish_reason is not None)
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if error is not None:
        print(f"splitfuse generate: error: {error}", file=sys.stderr)
        return 1
    return 0
