"""Test-wide setup. TRITON_INTERPRET must be set before any @triton.jit function is defined."""

import os
import sys

if os.environ.get("TRITON_INTERPRET") != "0" and "numpy" not in sys.modules:
    # Set before torch loads numpy. The Triton interpreter's tl.dot is numpy's matmul, and
    # OpenBLAS's Haswell kernels (the ones it picks on AVX2 CPUs, and the ones an environment
    # names for CPUs it does not know, such as AMD's family 26) sum a row in an order that
    # depends on where the row sits in the tile, which no GPU's matrix unit does: the Triton
    # kernels' batch-invariance tests would fail for the BLAS's sake. Its AVX kernels sum every
    # row of a tile alike, and the tests' shapes are too small for their speed to matter.
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

if "TRITON_INTERPRET" not in os.environ:
    import torch

    # Triton kernels compile on a CUDA device and run in the interpreter everywhere else.
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A session that ends while a server's step graphs still compile in the background (a
    server fixture of the last module, a run stopped by -x) leaves with its own exit status, as
    ``splitfuse serve`` does (``server/runner.py``): the interpreter's exit would crash under the
    compile thread (SIGSEGV, exit status 139, after every test passed)."""
    step_graphs = sys.modules.get("engine.step_graphs")
    if step_graphs is not None and step_graphs.compiling_in_background():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash.get(_EXIT_STATUS, 1))


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder (2 layers, hidden 64, 4 heads / 2 KV heads, float32)."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 folder (QKV bias), same sizes as ``tiny_llama_dir``."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), prepared once into the cache directory."""
    from engine.model_resolver import prepare_model

    return prepare_model(progress=False)
