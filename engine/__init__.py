"""The engine: models, the ragged forward over the paged KV cache, sampling, offline generation.

Heavy modules (torch, transformers) load on first use of ``LLM`` or ``LLMEngine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine

__all__ = ["LLM", "EngineConfig", "LLMEngine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
