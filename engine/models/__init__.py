"""Model classes by the architecture name found in ``config.json``."""

from __future__ import annotations

from torch import nn

from engine.model_config import SUPPORTED_ARCHITECTURES
from engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES
}

__all__ = ["MODEL_CLASSES", "LlamaForCausalLM"]
