"""The ``splitfuse`` command line: one subcommand per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# subcommand -> module exposing ``register(subparsers)``; each registers its parser and sets
# ``func(args) -> int`` as the parser default. Registration imports nothing heavy.
COMMANDS: dict[str, str] = {
    "serve": "server.serve_command",
    "bench": "server.bench_command",
    "generate": "server.generate_command",
    "model": "server.model_command",
    "top": "server.top_command",
}


def _version() -> str:
    try:
        return version("splitfuse")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitfuse",
        description="splitfuse: an OpenAI-compatible LLM server with Dynamic SplitFuse batching",
    )
    parser.add_argument("--version", action="version", version=f"splitfuse {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
