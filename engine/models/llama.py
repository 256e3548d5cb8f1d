"""The Llama family (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2) and its mixture-of-experts
relatives (Mixtral, Qwen2-MoE, Qwen3-MoE) over the paged KV cache.

One ragged forward: every row's tokens are flattened into ``[num_tokens]`` (see
``engine/input_builder.py``); attention reads each row's context through its block table, so a
prompt chunk and a decode token are the same case. Qwen2 differs only by its q/k/v bias; the MoE
models by their MLP, a sparse mixture of experts (``engine/moe.py``) in every layer or some, and
Qwen3-MoE by an RMSNorm over each query and key head before rotary. Attention
is always full: a sliding-window model is limited to contexts within its window (see
``ModelConfig.max_context_len``), where the two agree.

The ops come from an attention backend object (``kernels/``); the step's ``plan`` (its checked
metadata and the KV cache) is made by the runner with ``backend.plan`` and passed down explicitly.
Each module has one forward; the runner decides how it runs (eager, or ``LlamaModel`` compiled).

    embed -> [RMSNorm -> QKV (-> q/k norm) -> rotary -> store K/V + paged attention -> o_proj
              -> RMSNorm -> gate_up -> SiLU * up -> down (or the MoE block)] x num_layers
          -> final RMSNorm -> (sampling rows only) LM head
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from engine.model_config import ModelConfig
from engine.moe import (
    SparseMoeBlock,
    StackedExperts,
    expert_param_name,
    split_stacked_experts,
)
from engine.parallel import SINGLE_PROCESS, ParallelContext
from engine.tensor_parallel.sharding import shard_heads
from kernels import AttentionBackend, build_cos_sin_cache

Rope = tuple[torch.Tensor, torch.Tensor]  # the step's rotary rows, in the backend's form


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, the residual stream ``x + residual``)."""
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        parallel: ParallelContext,
        layer_index: int,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.layer_index = layer_index
        head_dim = config.head_dim
        heads = shard_heads(
            config.num_heads, config.num_kv_heads, parallel.rank, parallel.world_size
        )
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        q_range = (heads.head_start * head_dim, heads.num_heads * head_dim)
        kv_range = (heads.kv_head_start * head_dim, heads.num_kv_heads * head_dim)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [
                config.num_heads * head_dim,
                config.num_kv_heads * head_dim,
                config.num_kv_heads * head_dim,
            ],
            bias=config.attention_bias,
            dtype=dtype,
            parallel=parallel,
            shard_ranges=[q_range, kv_range, kv_range],
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * head_dim, config.hidden_size, bias=False, dtype=dtype,
            parallel=parallel, input_range=q_range,
        )  # fmt: skip
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype, backend)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype, backend)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rope: Rope,
        plan: Any,  # the backend's step plan
    ) -> torch.Tensor:
        num_tokens, head_dim = hidden.shape[0], self.head_dim
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        # query and key heads side by side, rotated at once: [num_tokens, num_qk_heads, head_dim]
        qk = qkv[:, : num_qk_heads * head_dim].view(num_tokens, num_qk_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, _ = self.q_norm(qk[:, : self.num_heads].reshape(-1, head_dim))
            k, _ = self.k_norm(qk[:, self.num_heads :].reshape(-1, head_dim))
            qk = torch.cat([q.view(num_tokens, -1, head_dim), k.view(num_tokens, -1, head_dim)], 1)
        qk = self.backend.rotary(qk, rope)
        v = qkv[:, num_qk_heads * head_dim :].view(num_tokens, self.num_kv_heads, head_dim)
        attended = self.backend.attend(
            qk[:, : self.num_heads], qk[:, self.num_heads :], v, plan, self.layer_index, self.scale
        )  # [num_tokens, num_heads, head_dim]
        return self.o_proj(attended.reshape(num_tokens, self.num_heads * head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM; ``intermediate_size``
    wide (default: the config's; a shared expert has its own)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        parallel: ParallelContext,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [size, size], bias=False, dtype=dtype, parallel=parallel
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=False, dtype=dtype, parallel=parallel
        )
        self.local_size = self.gate_up_proj.local_output_sizes[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (one fused call where the backend has one for the weights)
        act = self.backend.silu_mul_product(self.gate_up_proj, x)
        if act is None:
            gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * local_size]: gate, then up
            act = self.backend.silu_mul(gate_up)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        parallel: ParallelContext,
        layer_index: int,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, backend, parallel, layer_index)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_index):
            shared_size = config.shared_expert_intermediate_size
            shared = MLP(config, dtype, backend, parallel, shared_size) if shared_size else None
            self.mlp = SparseMoeBlock(config, dtype, backend, parallel, shared)
        else:
            self.mlp = MLP(config, dtype, backend, parallel)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, backend)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # None in the first layer
        rope: Rope,
        plan: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it is added)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, plan)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack: ``forward(input_ids, positions, plan)`` -> the final norm's output
    ``[num_tokens, hidden_size]``. The runner may compile this module (``engine/step_graphs.py``):
    its inputs are tensors of any token count and the opaque plan."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        max_position: int,
        parallel: ParallelContext,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype, parallel=parallel
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, backend, parallel, index)
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, backend)
        cos_sin = build_cos_sin_cache(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling
        )
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        plan: Any,
    ) -> torch.Tensor:
        rope = self.backend.rope(positions, self.cos_sin_cache)
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, plan)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids, positions, plan, sample_rows) -> logits`` for the sampling rows only,
    float32 ``[num_sampled, vocab_size]``; ``plan`` is ``backend.plan(positions, metadata,
    kv_cache, max_position)`` for the step."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        backend: AttentionBackend,
        max_position: int,
        parallel: ParallelContext = SINGLE_PROCESS,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.max_position = max_position
        self.model = LlamaModel(config, dtype, backend, max_position, parallel)
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            parallel=parallel,
            tied_embedding=self.model.embed_tokens if config.tie_word_embeddings else None,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        plan: Any,
        sample_rows: torch.Tensor,  # [num_sampled]
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, plan)  # [num_tokens, hidden_size]
        return self.compute_logits(hidden, sample_rows)

    def compute_logits(self, hidden: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        """The LM head on the sampling rows of the stack's output: float32 ``[num_sampled,
        vocab_size]``."""
        return self.lm_head(hidden[sample_rows]).float()

    # -- weights ---------------------------------------------------------------------------

    # checkpoint name fragment -> (our parameter's name fragment, shard index in the fused layer)
    _FUSED = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def load_weights(self, weights: Any) -> None:
        """Copies ``(name, slice)`` pairs (Hugging Face names) into the parameters; raises
        ValueError naming what is missing, unexpected or misshapen."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for checkpoint_name, tensor in split_stacked_experts(weights):
            name, shard_id = self.param_name(checkpoint_name)
            if name is None:
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {checkpoint_name!r} in the checkpoint")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                try:
                    loader(param, tensor, shard_id)
                except ValueError as error:
                    raise ValueError(f"{checkpoint_name}: {error}") from None
            loaded.add(f"{name}#{shard_id}")
        expected = self._expected_keys(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")

    def param_name(self, checkpoint_name: str) -> tuple[str | None, int]:
        """A checkpoint name's parameter here and its part in a fused layer; None: not kept."""
        if "rotary_emb.inv_freq" in checkpoint_name:
            return None, 0
        expert = expert_param_name(checkpoint_name)
        if expert is not None:
            return expert
        name = checkpoint_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's router
        if name == "lm_head.weight":
            return (None, 0) if self.config.tie_word_embeddings else ("lm_head.weight", 0)
        for fragment, (fused, shard_id) in self._FUSED.items():
            if fragment in name:
                return name.replace(fragment, fused), shard_id
        return name, 0

    def _expected_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        keys = set()
        modules = dict(self.named_modules())
        for name in params:
            module_name, _, param_name = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, StackedExperts):
                keys.update(f"{name}#{shard}" for shard in module.expected_shard_ids(param_name))
            elif ".qkv_proj." in name:
                keys.update(f"{name}#{shard}" for shard in range(3))
            elif ".gate_up_proj." in name:
                keys.update(f"{name}#{shard}" for shard in range(2))
            else:
                keys.add(f"{name}#0")
        return keys
