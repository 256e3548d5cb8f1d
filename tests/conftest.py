"""Test-wide setup. TRITON_INTERPRET must be set before any @triton.jit function is defined."""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    # Triton kernels compile on a CUDA device and run in the interpreter everywhere else.
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


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
