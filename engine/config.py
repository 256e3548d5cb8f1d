"""Engine configuration: one pydantic model, validated once at the edge and frozen afterwards."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# decode steps per scheduling pass where the engine can run several (num_scheduler_steps None)
DEFAULT_SCHEDULER_STEPS = 4

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


class QuantizationConfig(BaseModel):
    """Weight-only quantization (``engine/quantization.py``). Written as a method name
    (``"int4"``), as this model (``{method: int4, group_size: 64}``), or in DeepSpeed's nested form
    (``{enabled: true, weight: {num_bits: 4, group_size: 64, symmetric: false}}``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["none", "auto", "int8", "int4"] = Field(
        "none",
        description="int8: symmetric 8-bit weights; int4: asymmetric 4-bit weights in groups; "
        "auto: int4 on a CPU that runs the quantized product natively, else none",
    )
    group_size: int | None = Field(
        None,
        description="values per scale along the input features: int4 32 (default), 64 or 128; "
        "int8 one group per output channel (default) or 32, 64, 128",
    )
    embeddings: Literal["int8", "none"] = Field(
        "int8",
        description="the token embedding and the LM head: 8-bit in groups of 32 (as GGUF files "
        "store them), or left in the model's dtype",
    )

    @model_validator(mode="before")
    @classmethod
    def _accepted_forms(cls, value: Any) -> Any:
        if value is None or value is False:
            value = {"method": "none"}
        elif isinstance(value, str):
            value = {"method": value}
        elif isinstance(value, dict) and ("enabled" in value or "weight" in value):
            value = _from_deepspeed(value)
        if isinstance(value, dict) and value.get("method") == "int4" and "group_size" not in value:
            value = {**value, "group_size": 32}
        return value

    @model_validator(mode="after")
    def _supported(self) -> QuantizationConfig:
        allowed = {"int4": (32, 64, 128), "int8": (None, 32, 64, 128)}.get(self.method)
        if allowed is not None and self.group_size not in allowed:
            raise ValueError(
                f"group_size {self.group_size} is not supported for {self.method}: use one of "
                + ", ".join("per channel (none)" if size is None else str(size) for size in allowed)
            )
        if allowed is None and self.group_size is not None:
            raise ValueError(
                f"group_size means nothing without quantization (method {self.method})"
            )
        return self

    @property
    def bits(self) -> int:
        return {"int4": 4, "int8": 8}.get(self.method, 0)


def _from_deepspeed(value: dict[str, Any]) -> dict[str, Any]:
    """``{enabled, weight: {num_bits, group_size, symmetric}}`` -> our fields; what has no
    meaning here is refused by name."""
    unknown = sorted(set(value) - {"enabled", "weight"})
    if unknown:
        raise ValueError(f"unsupported quant field(s): {', '.join(unknown)} (enabled, weight)")
    if not value.get("enabled", True):
        return {"method": "none"}
    weight = dict(value.get("weight") or {})
    unknown = sorted(set(weight) - {"num_bits", "group_size", "symmetric", "q_groups"})
    if unknown:
        raise ValueError(
            f"unsupported quant.weight field(s): {', '.join(unknown)} "
            "(num_bits, group_size, symmetric)"
        )
    num_bits = weight.get("num_bits", 8)
    if num_bits not in (4, 8):
        raise ValueError(f"quant.weight.num_bits must be 4 or 8, got {num_bits!r}")
    symmetric = weight.get("symmetric", num_bits == 8)
    if num_bits == 4 and symmetric:
        raise ValueError("4-bit weights are asymmetric here (a scale and a min per group)")
    if num_bits == 8 and not symmetric:
        raise ValueError("8-bit weights are symmetric here (one scale per group)")
    out: dict[str, Any] = {"method": f"int{num_bits}"}
    if weight.get("group_size") is not None:
        out["group_size"] = weight["group_size"]
    return out


class EngineConfig(BaseModel):
    """Everything the engine needs. Short aliases are accepted (``tp``, ``dtype`` ...)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    model: str = Field(DEFAULT_MODEL, description="model folder, or the name of a prepared model")
    tokenizer: str | None = Field(None, description="tokenizer folder (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8", "float8_e4m3fn"] = (
        Field(
            "auto",
            description="the KV cache's dtype. auto: the model's dtype, but float16 on a CPU where "
            "activations are float32 and the weights quantized (decode attention reads half the "
            "bytes; see the README's Quantization). fp8 (float8_e4m3fn): one byte a value, no "
            "scale, K/V beyond +-448 stored as +-448. Another dtype than the model's needs the "
            "torch attention backend",
        )
    )
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
        "the default model on 2 cores); on a GPU (Triton backend, one process), capture CUDA "
        "graphs of decode steps at start-up",
    )
    num_threads: int | None = Field(None, ge=1, description="CPU threads (default: all cores)")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: arrival order; priority: the requests' priority (lower first), then "
        "arrival, with aging and preemption of lower priorities (see the scheduler)",
    )
    quantization: QuantizationConfig = Field(
        default_factory=QuantizationConfig,
        validation_alias=AliasChoices("quantization", "quant"),
        description="weight-only quantization: none, int8, int4 or auto (see QuantizationConfig)",
    )
    fair_share: bool = Field(
        False, description="share each step's prompt-token budget between tenants"
    )
    num_scheduler_steps: int | None = Field(
        None,
        ge=1,
        le=64,
        description="decode steps a batch runs per scheduling pass where every request in it "
        "decodes greedily with no logprobs, penalties, logit_bias or structured output, none is "
        "streamed (a streamed request keeps a step a pass) and no prompt waits; a request that "
        "arrives meanwhile waits for the pass. Needs the CPU decode stack with the 8-bit LM "
        f"head; None: {DEFAULT_SCHEDULER_STEPS} there, else 1",
    )
    deterministic: bool = Field(
        False,
        description="bitwise-identical tokens and logprobs for a request whatever else runs, "
        "the step budget, chunking, preemption or prefix-cache hits (same model, dtype, machine "
        "and thread count); costs up to ~1.4-1.7x at 32 requests (see the README)",
    )

    @model_validator(mode="after")
    def _deterministic_in_one_process(self) -> EngineConfig:
        if self.deterministic and self.tensor_parallel_size > 1:
            raise ValueError(
                "deterministic mode runs in one process: the ranks' all-reduce sums in an order "
                "that depends on the tensor's size, so on the batch (use tensor_parallel_size 1)"
            )
        return self

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_kv_memory(cls, value: str | int | float) -> int | float:
        parsed = parse_memory(value)
        if isinstance(parsed, float) and not 0 < parsed < 1 and parsed < 1024:
            raise ValueError("a fraction must be in (0, 1); a size needs a unit (e.g. 4GiB)")
        return parsed
