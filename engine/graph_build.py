"""Compiles a model's step graphs in a process of their own, for a serving process that then runs
them without torch's compiler.

Where every step graph runs under inductor's C++ wrapper (quantized products on a CPU: see
``engine/step_graphs.py``), a graph is a shared library whose entry point
``splitfuse_cpu.GraphCall`` calls, given the weights it reads and the step's tensors. Running it
needs none of the compiler, but compiling it in the serving process imports the compiler (dynamo,
inductor, sympy: ~110 MiB of modules for the default model) and leaves its state there for good
(~100 MiB more on a cold compile). So the runner hands its arguments to this module instead:

    serving process                          python -m engine.graph_build SPEC MANIFEST
    ModelRunner(compile=True)  -- SPEC -->   the same model, a KV cache of a few blocks
      serves eagerly meanwhile               StepGraphs.start(): compiles both graphs
    StepGraphs._load_built()  <-- MANIFEST   each graph's library, the sources of its
                                             arguments, its output on a dummy step
      entry points bound to its own weights, each checked to give that output bit for bit
      on the same dummy step; steps switch to them

The child loads the weights from the model folder itself (a runner given its weights in memory
compiles its graphs in the serving process), uses inductor's caches as any compile does, and
exits if the serving process goes away. The libraries stay in inductor's cache folder, which the
manifest points into, and the manifest is kept in ``<splitfuse cache>/compile/<CPU kind>/graphs``,
under a key of everything the graphs depend on (the runner's arguments, the model folder's files,
this package's code, torch's and Python's versions): a later start with the same key loads the
graphs at once, with the same checks, and builds them again only where they do not fit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# a cold compile of the default model takes ~2-3 minutes on 2 cores
BUILD_TIMEOUT_SECONDS = 1800.0
# runner arguments of the child that differ from the serving runner's: no compile of its own, a
# KV cache just large enough for the dummy steps (two blocks for each of their rows)
CHILD_OVERRIDES = {"compile": False, "num_kv_blocks": 8}


class GraphBuild:
    """The graphs of one runner's model: kept from an earlier start (``cached``), or built in
    another process (``build``) and then kept (``keep``)."""

    def __init__(self, runner_kwargs: dict[str, Any], threads: int) -> None:
        """``runner_kwargs``: ``ModelRunner``'s arguments (a model folder, not tensors);
        ``threads``: the serving process's CPU threads."""
        self.runner_kwargs = runner_kwargs
        self.threads = threads
        self.path = _manifest_path(runner_kwargs, threads)

    def cached(self) -> dict | None:
        """The manifest an earlier start kept for the same key, or None."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def build(self) -> dict:
        return build_in_child(self.runner_kwargs, self.threads)

    def keep(self, manifest: dict) -> None:
        """Keeps ``manifest`` for later starts (a failure to write is logged, not raised)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.partial")
            partial.write_text(json.dumps(manifest))
            partial.replace(self.path)
        except OSError as error:
            logger.warning("compile: the graphs' manifest could not be kept (%s)", error)


def _manifest_path(runner_kwargs: dict[str, Any], threads: int) -> Path:
    """``<splitfuse cache>/compile/<CPU kind>/graphs/<key>.json``; the key covers what the
    graphs depend on: the runner's arguments but the KV cache's size and the seed, the model
    folder's files (names, sizes, times), this package's code, torch's and Python's versions."""
    import torch

    from engine.device import cpu_code_tag
    from engine.model_resolver import cache_dir

    key = hashlib.sha256()
    ignored = {"kv_cache_memory", "num_kv_blocks", "max_useful_blocks", "seed"}
    for name in sorted(set(runner_kwargs) - ignored):
        key.update(f"{name}={runner_kwargs[name]!r}\n".encode())
    key.update(f"threads={threads} torch={torch.__version__} python={sys.version}\n".encode())
    folder = Path(runner_kwargs["model_dir"])
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        stat = path.stat()
        key.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    root = Path(__file__).resolve().parent.parent
    for package in ("engine", "kernels"):
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".cpp", ".h"):
                key.update(path.relative_to(root).as_posix().encode())
                key.update(path.read_bytes())
    return cache_dir() / "compile" / cpu_code_tag() / "graphs" / f"{key.hexdigest()[:32]}.json"


def build_in_child(
    runner_kwargs: dict[str, Any], threads: int, timeout: float = BUILD_TIMEOUT_SECONDS
) -> dict:
    """Runs ``python -m engine.graph_build`` on ``runner_kwargs`` (``ModelRunner``'s
    arguments) with ``threads`` CPU threads (the serving process's: the graphs' dummy outputs
    are compared bit for bit) and returns the manifest it wrote. Raises RuntimeError with the
    tail of the child's log where it fails or runs past ``timeout`` seconds."""
    kwargs = {**runner_kwargs, **CHILD_OVERRIDES, "threads": threads}
    with tempfile.TemporaryDirectory(prefix="splitfuse-graphs-") as folder:
        spec, manifest, log = (Path(folder) / name for name in ("spec", "manifest", "log"))
        with spec.open("wb") as file:
            pickle.dump(kwargs, file)
        command = [sys.executable, "-m", "engine.graph_build", str(spec), str(manifest)]
        start = time.perf_counter()
        with log.open("wb") as output:
            child = subprocess.Popen(  # noqa: S603 (our own interpreter and module)
                command, stdout=output, stderr=subprocess.STDOUT, env=_child_env()
            )
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                raise RuntimeError(
                    f"building the step graphs took over {timeout:.0f} s:\n{_tail(log)}"
                ) from None
        if code != 0 or not manifest.exists():
            raise RuntimeError(f"building the step graphs failed (exit code {code}):\n{_tail(log)}")
        logger.info("compile: graphs built by process %d in %.1f s", child.pid,
                    time.perf_counter() - start)  # fmt: skip
        return json.loads(manifest.read_text())


def _child_env() -> dict[str, str]:
    """This process's environment, with its module folder first on the child's path (so that
    ``-m engine.graph_build`` finds this same code whatever the working folder)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _exit_with_parent() -> None:
    """Ends this process when the one that started it is gone (its parent id changes)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="splitfuse-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m engine.graph_build SPEC MANIFEST", file=sys.stderr)
        return 2
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec, manifest = (Path(arg) for arg in argv)
    with spec.open("rb") as file:
        kwargs = pickle.load(file)  # noqa: S301 (written by our own parent process)
    import torch

    torch.set_num_threads(kwargs.pop("threads"))
    from engine.model_runner import ModelRunner
    from engine.step_graphs import COMPILED, StepGraphs

    runner = ModelRunner(**kwargs)
    graphs = StepGraphs(
        runner.model,
        compile=True,
        operator_step=runner.backend.operator_step,
        one_token_steps=runner.one_token_steps,
    )
    graphs.start(runner._dummy_step, background=False)
    if graphs.mode != COMPILED:
        print("the step graphs did not compile (see the log above)", file=sys.stderr)
        return 1
    written = manifest.with_suffix(".partial")
    written.write_text(json.dumps(graphs.manifest(runner._dummy_step)))
    written.replace(manifest)
    # the compiler's threads make the interpreter's exit abort (see step_graphs)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
