"""The model's shape, read from a Hugging Face ``config.json``, validated and frozen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# architecture name in config.json -> whether its attention q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
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
        return cls(
            architecture=architecture,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(get("intermediate_size")),
            num_layers=int(get("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=SUPPORTED_ARCHITECTURES[architecture]
            or bool(raw.get("attention_bias", False)),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=_sliding_window(raw),
        )


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
