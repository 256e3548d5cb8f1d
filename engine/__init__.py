"""The engine: models, the ragged forward over the paged KV cache, sampling, offline generation,
and ``init_inference`` on a loaded transformers model.

Heavy modules (torch, transformers) load on first use of ``LLM``, ``LLMEngine`` or
``init_inference``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.inference import InferenceConfig, init_inference
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine

__all__ = [
    "LLM",
    "EngineConfig",
    "InferenceConfig",
    "LLMEngine",
    "SamplingParams",
    "init_inference",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("init_inference", "InferenceConfig"):
        import engine.inference

        return getattr(engine.inference, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
