"""The engine with ``attention_backend="triton"`` (interpreted on a CPU, compiled on CUDA) runs the
tiny model end to end and produces the same greedy tokens as the torch backend."""

from __future__ import annotations

import os

import pytest
import torch

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

pytest.importorskip("triton")

from kernels.triton_backend import TritonBackend  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A serving system",
    "Once upon a time",
    "What is the capital of France?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# The kernels compile on CUDA unless TRITON_INTERPRET=1; the interpreter runs on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def _greedy_tokens(model_dir, backend: str) -> list[list[int]]:
    # A 16-token budget splits the longer prompts into chunks fused with the others' decodes.
    llm = LLM(
        model=str(model_dir), attention_backend=backend, device=DEVICE, dtype="float32",
        max_batch_tokens=16, block_size=16, num_kv_blocks=32,
    )  # fmt: skip
    return [result.token_ids for result in llm.generate(PROMPTS, GREEDY)]


def test_triton_backend_matches_torch_backend(tiny_llama_dir, monkeypatch):
    calls = dict.fromkeys(("plan", "paged_attention", "store_kv", "rms_norm", "rotary"), 0)
    for name in calls:
        op = getattr(TritonBackend, name)

        def counted(*args, _op=op, _name=name, **kwargs):
            calls[_name] += 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(TritonBackend, name, counted)
    triton_tokens = _greedy_tokens(tiny_llama_dir, "triton")
    assert all(count > 0 for count in calls.values()), calls
    assert triton_tokens == _greedy_tokens(tiny_llama_dir, "torch")
    assert all(len(tokens) == GREEDY.max_tokens for tokens in triton_tokens)
