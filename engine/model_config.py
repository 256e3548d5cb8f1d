"""The model's shape, read from a Hugging Face ``config.json``, validated and frozen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# architecture name in config.json -> whether its attention q/k/v projections carry a bias
# (Qwen2-MoE: its config's ``qkv_bias``)
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "MixtralForCausalLM": False,
    "Qwen2MoeForCausalLM": False,
    "Qwen3MoeForCausalLM": False,
}
# the mixture-of-experts architectures among them (``_moe_fields`` reads their experts)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """The model folder's configuration is missing, malformed or unsupported."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain rotary; else a dict with "rope_type" ("linear" or "llama3") and its factors
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Mistral-style sliding-window attention, when the model uses it (None: full attention)
    sliding_window: int | None = None
    # Qwen3: RMSNorm over each query and key head (head_dim) before rotary
    qk_norm: bool = False
    # Mixture of experts (``engine/moe.py``); 0 experts: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    # layers of an MoE model whose MLP is dense (``intermediate_size`` wide)
    dense_mlp_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether the layer's MLP is a sparse mixture of experts."""
        return self.num_experts > 0 and layer_index not in self.dense_mlp_layers

    @property
    def max_context_len(self) -> int:
        """The longest context this engine runs exactly: full attention is computed, so a
        sliding-window model is limited to its window."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Reads ``config.json`` (and ``generation_config.json`` for extra EOS ids)."""
        config_path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"no config.json in {model_dir}") from None
        except json.JSONDecodeError as error:
            raise ModelConfigError(f"{config_path} is not valid JSON: {error}") from None
        generation_path = Path(model_dir) / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        architectures = raw.get("architectures") or []
        supported = [name for name in architectures if name in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ModelConfigError(
                f"unsupported architecture {architectures or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = supported[0]

        def get(key: str, default: Any = None) -> Any:
            value = raw.get(key, default)
            if value is None:
                raise ModelConfigError(f"config.json has no {key!r}")
            return value

        hidden_size = int(get("hidden_size"))
        num_heads = int(get("num_attention_heads"))
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        if head_dim % 2:
            raise ModelConfigError(f"rotary embedding needs an even head_dim, got {head_dim}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        rope_theta, rope_scaling = _rope(raw)
        eos_ids = _token_ids(raw.get("eos_token_id")) + _token_ids(
            (generation or {}).get("eos_token_id")
        )
        num_layers = int(get("num_hidden_layers"))
        moe = (
            _moe_fields(architecture, raw, num_layers) if architecture in MOE_ARCHITECTURES else {}
        )
        attention_bias = moe.pop(
            "attention_bias",
            SUPPORTED_ARCHITECTURES[architecture] or bool(raw.get("attention_bias", False)),
        )
        return cls(
            architecture=architecture,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(get("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=_sliding_window(raw),
            **moe,
        )


def _moe_fields(architecture: str, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The experts of a Mixtral / Qwen2-MoE / Qwen3-MoE config, checked.

    Mixtral: ``num_local_experts`` experts of ``intermediate_size``, top-k renormalized, in every
    layer. Qwen: ``num_experts`` of ``moe_intermediate_size``, renormalized with
    ``norm_topk_prob``; layer i is sparse when ``(i + 1) % decoder_sparse_step == 0`` and i is not
    in ``mlp_only_layers``, dense (``intermediate_size``) otherwise. Qwen2-MoE adds a shared
    expert and q/k/v biases (``qkv_bias``), Qwen3-MoE a per-head q/k norm.
    """

    def positive(key: str, value: Any) -> int:
        if value is None:
            raise ModelConfigError(f"config.json has no {key!r}")
        if int(value) < 1:
            raise ModelConfigError(f"{key} must be >= 1, got {value}")
        return int(value)

    top_k = positive("num_experts_per_tok", raw.get("num_experts_per_tok"))
    fields: dict[str, Any] = {"num_experts_per_tok": top_k}
    if architecture == "MixtralForCausalLM":
        fields["num_experts"] = positive("num_local_experts", raw.get("num_local_experts"))
        fields["moe_intermediate_size"] = positive(
            "intermediate_size", raw.get("intermediate_size")
        )
        fields["norm_topk_prob"] = True
    else:
        key = "num_experts" if "num_experts" in raw else "num_local_experts"
        fields["num_experts"] = positive(key, raw.get(key))
        fields["moe_intermediate_size"] = positive(
            "moe_intermediate_size", raw.get("moe_intermediate_size")
        )
        fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", False))
        step = positive("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
        mlp_only = [int(index) for index in raw.get("mlp_only_layers") or []]
        outside = [index for index in mlp_only if not 0 <= index < num_layers]
        if outside:
            raise ModelConfigError(f"mlp_only_layers {outside} are not layers of {num_layers}")
        fields["dense_mlp_layers"] = tuple(
            index for index in range(num_layers) if index in mlp_only or (index + 1) % step
        )
    if architecture == "Qwen2MoeForCausalLM":
        fields["shared_expert_intermediate_size"] = positive(
            "shared_expert_intermediate_size", raw.get("shared_expert_intermediate_size")
        )
        fields["attention_bias"] = bool(raw.get("qkv_bias", True))
    if architecture == "Qwen3MoeForCausalLM":
        fields["qk_norm"] = True
    if top_k > fields["num_experts"]:
        raise ModelConfigError(
            f"num_experts_per_tok ({top_k}) exceeds the number of experts ({fields['num_experts']})"
        )
    return fields


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """Qwen2 configs carry a window that applies only with ``use_sliding_window``."""
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window", True) is False:
        return None
    return int(window)


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(token_id) for token_id in value)


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either layout: transformers 5 ``rope_parameters`` (theta inside) or
    the older ``rope_theta`` + ``rope_scaling``."""
    parameters = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(parameters.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    parameters["rope_type"] = rope_type
    parameters.pop("type", None)
    return theta, parameters
