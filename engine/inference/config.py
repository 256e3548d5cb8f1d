"""``init_inference``'s configuration: DeepSpeed-Inference's field names and aliases, mapped onto
``EngineConfig``.

    DeepSpeed field (aliases)                      here
    dtype                                          EngineConfig.dtype (default: the model's)
    tensor_parallel.tp_size (tp; tp_size, mp_size) EngineConfig.tensor_parallel_size
    replace_with_kernel_inject (kernel_inject)     always true: the model runs on our layers
    enable_cuda_graph                              EngineConfig.compile (CUDA graphs of decode
                                                   steps on a GPU, compiled step graphs on a CPU)
    quant {enabled, weight: {num_bits, ...}}       EngineConfig.quantization
    max_out_tokens (max_tokens)                    EngineConfig.max_model_len (prompt + output)
    moe {enabled, ep_size, moe_experts, type}      checked against the model's experts
    (ep_size, moe_experts, moe_type)               -> moe.*
    engine                                         ours: any other EngineConfig field

Validated once, at construction, then frozen. An unknown key is an error; a DeepSpeed field that
means nothing for this engine (``injection_policy``, ``checkpoint``, ``zero`` ...) is refused by
name with the reason, never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import EngineConfig, QuantizationConfig

# DeepSpeed-Inference fields without a meaning here -> why
REFUSED_FIELDS: dict[str, str] = {
    "injection_policy": "kernel injection covers the architectures this engine implements; "
    "a policy cannot teach it another",
    "injection_dict": "kernel injection covers the architectures this engine implements; "
    "a policy cannot teach it another",
    "injection_policy_tuple": "kernel injection covers the architectures this engine implements; "
    "a policy cannot teach it another",
    "replace_method": "kernel injection covers the architectures this engine implements",
    "checkpoint": "the weights come from the model object given; nothing is read from disk",
    "checkpoint_config": "the weights come from the model object given",
    "base_dir": "the weights come from the model object given",
    "save_mp_checkpoint_path": "sharded checkpoints are not written",
    "set_empty_params": "the weights come from the model object given",
    "zero": "ZeRO inference (weights offloaded by DeepSpeed's runtime) does not exist here",
    "keep_module_on_host": "the engine places its own layers (engine.device)",
    "mpu": "tensor-parallel ranks are processes the engine starts; no external process groups",
    "training_mp_size": "the weights come unsharded from the model object",
    "ep_group": "no expert-parallel process groups",
    "ep_mp_group": "no expert-parallel process groups",
    "use_triton": "Triton kernels are chosen by the device (engine.attention_backend)",
    "triton_autotune": "Triton kernels are tuned by the engine",
    "triangular_masking": "attention is always causal here",
    "tm": "attention is always causal here",
    "return_tuple": "the forward returns transformers' output object",
    "transposed_mode": "weights keep transformers' layout",
    "min_out_tokens": "the KV cache is sized by engine.kv_cache_memory or engine.num_kv_blocks",
    "config": "the model's own transformers config is read",
}
# fields of EngineConfig that init_inference's own fields set (or the model object gives)
_OWN_ENGINE_FIELDS: dict[str, str] = {
    "model": "the model object given",
    "tokenizer": "the model object given (the engine runs token ids)",
    "dtype": "dtype",
    "tensor_parallel_size": "tensor_parallel.tp_size",
    "tp": "tensor_parallel.tp_size",
    "compile": "enable_cuda_graph",
    "quantization": "quant",
    "quant": "quant",
    "max_model_len": "max_out_tokens",
}
_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def _refuse(value: Any, refused: dict[str, str], where: str) -> None:
    if not isinstance(value, dict):
        return
    for name, why in refused.items():
        if value.get(name) is not None:
            raise ValueError(f"{where}{name} is not supported: {why}")


class TensorParallelConfig(BaseModel):
    """DeepSpeed's ``tensor_parallel``: ``tp_size`` ranks on this machine, started by the engine
    (gloo on CPUs, NCCL on GPUs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    tp_size: int = Field(1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, value: Any) -> Any:
        _refuse(
            value,
            {
                "mpu": REFUSED_FIELDS["mpu"],
                "tp_group": REFUSED_FIELDS["mpu"],
                "tp_grain_size": "heads and features are split by the model's shapes",
            },
            "tensor_parallel.",
        )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TensorParallelConfig:
        if not self.enabled and self.tp_size > 1:
            raise ValueError(f"tensor_parallel.tp_size {self.tp_size} with enabled false")
        return self


class MoEConfig(BaseModel):
    """DeepSpeed's ``moe``: says the model has mixture-of-experts layers, which its model class
    (``engine/models``) runs; ``moe_experts``, when given, must be the model's expert count.
    Expert parallelism (``ep_size`` > 1) is not supported."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    ep_size: int = Field(1, ge=1)
    moe_experts: list[int] | None = None  # experts per MoE layer, as DeepSpeed lists them
    type: Literal["standard"] = "standard"

    @model_validator(mode="before")
    @classmethod
    def _accepted_forms(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return {"enabled": value}
        _refuse(
            value,
            {"ep_group": REFUSED_FIELDS["ep_group"], "ep_mp_group": REFUSED_FIELDS["ep_mp_group"]},
            "moe.",
        )
        return value

    @field_validator("ep_size")
    @classmethod
    def _no_expert_parallelism(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"ep_size {value}: expert parallelism is not supported")
        return value


class InferenceConfig(BaseModel):
    """``init_inference(model, config, **kwargs)``'s settings (see the module's table)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the engine's dtype (default: the model's); torch dtypes accepted"
    )
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig,
        validation_alias=AliasChoices("tensor_parallel", "tp"),
    )
    replace_with_kernel_inject: bool = Field(
        True, validation_alias=AliasChoices("replace_with_kernel_inject", "kernel_inject")
    )
    enable_cuda_graph: bool = Field(
        False,
        description="replay CUDA graphs of decode steps on a GPU (compiled step graphs on a CPU)",
    )
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    max_out_tokens: int | None = Field(
        None,
        ge=2,
        validation_alias=AliasChoices("max_out_tokens", "max_tokens"),
        description="the longest sequence, prompt and output (default: the model's context)",
    )
    moe: MoEConfig = Field(default_factory=lambda: MoEConfig(enabled=False))
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="other EngineConfig fields: num_kv_blocks, kv_cache_memory, block_size, "
        "max_batch_tokens, max_batch_seqs, device, attention_backend, seed, num_threads ...",
    )

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_forms(cls, value: Any) -> Any:
        """Refused fields by name; DeepSpeed's older top-level spellings moved where they go."""
        if not isinstance(value, dict):
            return value
        _refuse(value, REFUSED_FIELDS, "")
        value = dict(value)
        tp_sizes = {name: value.pop(name) for name in ("tp_size", "mp_size") if name in value}
        if tp_sizes:
            if len(set(tp_sizes.values())) > 1:
                raise ValueError(f"conflicting tensor-parallel sizes: {tp_sizes}")
            name, size = next(iter(tp_sizes.items()))
            key = "tp" if "tp" in value else "tensor_parallel"
            nested = dict(value.get(key) or {})
            if nested.get("tp_size", size) != size:
                raise ValueError(f"{name} {size} conflicts with tensor_parallel.tp_size")
            value[key] = {**nested, "tp_size": size}
        moe_fields = {"ep_size": "ep_size", "moe_experts": "moe_experts", "moe_type": "type"}
        moved = {moe_fields[name]: value.pop(name) for name in list(value) if name in moe_fields}
        if moved:
            moe = value.get("moe", True)
            nested = {"enabled": moe} if isinstance(moe, bool) else dict(moe)
            value["moe"] = {**nested, **moved}
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        """``torch.float16``, ``"fp16"``, ``"half"`` -> ``"float16"``; int8 asks for ``quant``."""
        if value is None:
            return None
        name = str(value).removeprefix("torch.")
        if name == "int8":
            raise ValueError(
                "int8 is a weight quantization here: quant={'enabled': True, 'weight': "
                "{'num_bits': 8}} with a float dtype for the activations"
            )
        if name not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {value!r}: use float32, bfloat16 or float16")
        return _DTYPE_NAMES[name]

    @field_validator("replace_with_kernel_inject")
    @classmethod
    def _always_injected(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "false is not supported: the model always runs on this engine's layers and "
                "kernels (its weights are moved into them)"
            )
        return value

    @field_validator("engine")
    @classmethod
    def _engine_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            if name in _OWN_ENGINE_FIELDS:
                raise ValueError(
                    f"{name} is not an engine option here: set it by {_OWN_ENGINE_FIELDS[name]}"
                )
        EngineConfig(**value)  # unknown names and bad values fail here, by name
        return value

    @model_validator(mode="after")
    def _compatible(self) -> InferenceConfig:
        if self.enable_cuda_graph and self.tensor_parallel.tp_size > 1:
            raise ValueError(
                "enable_cuda_graph with tensor_parallel.tp_size > 1: tensor-parallel ranks run "
                "the eager forward"
            )
        return self

    def engine_config(self, model_dtype: str) -> EngineConfig:
        """The engine's configuration; ``model_dtype`` (the model's) when ``dtype`` is unset."""
        return EngineConfig(
            **self.engine,
            dtype=self.dtype or model_dtype,
            tensor_parallel_size=self.tensor_parallel.tp_size,
            compile=self.enable_cuda_graph,
            quantization=self.quant,
            max_model_len=self.max_out_tokens,
        )
