"""Engine configuration: one pydantic model, validated once at the edge and frozen afterwards."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_memory(value: str | int | float) -> int | float:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 0.5 -> 0.5 (a fraction of free memory)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError("must be positive")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"cannot parse memory size {value!r} (examples: 4GiB, 512MB, 0.5)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if unit in ("", "b") and number < 1:
        return number
    base = 1024 if "i" in unit else 1000
    power = "bkmgt".index(unit[0]) if unit else 0
    size = int(number * base**power) if unit else int(number)
    if size <= 0:
        raise ValueError("must be positive")
    return size


class EngineConfig(BaseModel):
    """Everything the engine needs. Short aliases are accepted (``tp``, ``dtype`` ...)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    model: str = Field(DEFAULT_MODEL, description="model folder, or the name of a prepared model")
    tokenizer: str | None = Field(None, description="tokenizer folder (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_tokens: int = Field(
        512, ge=1, validation_alias=AliasChoices("max_batch_tokens", "max_num_batched_tokens")
    )
    max_batch_seqs: int = Field(
        128, ge=1, validation_alias=AliasChoices("max_batch_seqs", "max_num_seqs")
    )
    max_model_len: int | None = Field(
        None, ge=2, description="default: the model's max_position_embeddings"
    )
    block_size: int = Field(16, ge=1, le=256)
    kv_cache_memory: int | float = Field(
        0.3,
        description="bytes for the KV cache ('4GiB'), or a fraction (0, 1) of free memory",
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="override the sized block count")
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = Field(
        1, ge=1, validation_alias=AliasChoices("tensor_parallel_size", "tp")
    )
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    seed: int = 0
    compile: bool = Field(
        False,
        description="compile the step graphs (CPU, torch backend, one process): in the "
        "background from start-up, steps run eagerly until they are ready (about a minute for "
        "the default model on 2 cores)",
    )
    num_threads: int | None = Field(None, ge=1, description="CPU threads (default: all cores)")

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_kv_memory(cls, value: str | int | float) -> int | float:
        parsed = parse_memory(value)
        if isinstance(parsed, float) and not 0 < parsed < 1 and parsed < 1024:
            raise ValueError("a fraction must be in (0, 1); a size needs a unit (e.g. 4GiB)")
        return parsed
