"""The Llama family (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2) over the paged KV cache.

One ragged forward: every row's tokens are flattened into ``[num_tokens]`` (see
``engine/input_builder.py``); attention reads each row's context through its block table, so a
prompt chunk and a decode token are the same case. Qwen2 differs only by its q/k/v bias. Attention
is always full: a sliding-window model is limited to contexts within its window (see
``ModelConfig.max_context_len``), where the two agree. With an ops module that plans steps (the
torch backend's ``plan_step``), the batch's metadata is checked and indexed once per forward and
each layer runs the lean ``*_planned`` ops.

    embed -> [RMSNorm -> QKV -> rotary -> store K/V -> paged attention -> o_proj
              -> RMSNorm -> gate_up -> SiLU * up -> down] x num_layers
          -> final RMSNorm (sampling rows only) -> LM head
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.compiled_forward import OneTokenForward, is_recompile_error
from engine.input_builder import AttentionMetadata
from engine.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from engine.model_config import ModelConfig
from engine.parallel import SINGLE_PROCESS, ParallelContext
from engine.tp_sharding import shard_heads
from kernels import build_cos_sin_cache

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: ModuleType) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), False)
        self.add_rms_norm = getattr(ops, "add_rms_norm", None)  # unchecked, for the model's tensors

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.add_rms_norm is None:
            return self.ops.rms_norm(x, self.weight, self.eps, residual)
        normed, summed = self.add_rms_norm(x, residual, self.weight, self.eps)
        return normed if residual is None else (normed, summed)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: ModuleType,
        parallel: ParallelContext,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.ops = ops
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
        self.split_sizes = self.qkv_proj.local_output_sizes

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
        plan: Any = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if plan is not None:
            attended = self._attend_planned(qkv, key_cache, value_cache, plan)
            return self.o_proj(attended.view(num_tokens, self.num_heads * self.head_dim))
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        self.ops.rotary_embedding(positions, q, k, cos_sin_cache)
        self.ops.store_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        attended = self.ops.paged_attention(
            q,
            key_cache,
            value_cache,
            metadata.query_start,
            metadata.context_lens,
            metadata.block_tables,
            self.scale,
            metadata.max_query_len,
            metadata.max_context_len,
        )  # [num_tokens, num_heads, head_dim]
        return self.o_proj(attended.view(num_tokens, self.num_heads * self.head_dim))

    def forward_compiled(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim] float32 (StepPlan.cos)
        sin: torch.Tensor,  # [num_tokens, 1, head_dim] float32 (StepPlan.sin)
    ) -> torch.Tensor:
        """The traced form (``engine/compiled_forward.py``): rotary as a function of qkv, then
        the opaque ``attend_step`` stores K/V and attends with the step's plan."""
        num_tokens, head_dim = hidden.shape[0], self.head_dim
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, : num_qk_heads * head_dim].view(num_tokens, num_qk_heads, head_dim).float()
        qk = (qk * cos + torch.roll(qk, head_dim // 2, -1) * sin).to(qkv.dtype)
        v = qkv[:, num_qk_heads * head_dim :].view(num_tokens, self.num_kv_heads, head_dim)
        attended = torch.ops.splitfuse.attend_step(
            qk[:, : self.num_heads], qk[:, self.num_heads :], v, self.layer_index, self.scale
        )  # [num_tokens, num_heads, head_dim]
        return self.o_proj(attended.view(num_tokens, self.num_heads * head_dim))

    def _attend_planned(
        self, qkv: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: Any
    ) -> torch.Tensor:
        """Rotary, K/V store and attention with the step's plan (``ops.plan_step``)."""
        num_tokens, head_dim = qkv.shape[0], self.head_dim
        num_qk_heads = self.num_heads + self.num_kv_heads
        # [num_tokens, num_heads + num_kv_heads, head_dim]: q and k side by side, rotated at once
        qk = qkv[:, : num_qk_heads * head_dim].view(num_tokens, num_qk_heads, head_dim)
        self.ops.rotary_embedding_planned(qk, plan)
        k = qk[:, self.num_heads :]  # [num_tokens, num_kv_heads, head_dim]
        v = qkv[:, num_qk_heads * head_dim :].view(num_tokens, self.num_kv_heads, head_dim)
        self.ops.store_kv_planned(k, v, key_cache, value_cache, plan)
        return self.ops.paged_attention_planned(
            qk[:, : self.num_heads], key_cache, value_cache, plan.attention, self.scale
        )  # [num_tokens, num_heads, head_dim]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [size, size], bias=False, dtype=dtype, parallel=parallel
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=False, dtype=dtype, parallel=parallel
        )
        self.local_size = self.gate_up_proj.local_output_sizes[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * local_size]
        gate, up = gate_up[:, : self.local_size], gate_up[:, self.local_size :]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: ModuleType,
        parallel: ParallelContext,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, ops, parallel, layer_index)
        self.mlp = MLP(config, dtype, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        plan: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it is added)."""
        return self._around_attention(
            hidden,
            residual,
            lambda normed: self.self_attn(
                positions, normed, metadata, kv_cache, cos_sin_cache, plan
            ),
        )

    def forward_compiled(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` as the compiled graph traces it (``Attention.forward_compiled``)."""
        return self._around_attention(
            hidden, residual, lambda normed: self.self_attn.forward_compiled(normed, cos, sin)
        )

    def _around_attention(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attend: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm -> ``attend`` -> add + norm -> MLP; returns (output, residual stream)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = attend(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids, positions, metadata, kv_cache, sample_rows) -> logits`` for the
    sampling rows only, float32 ``[num_sampled, vocab_size]``."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        ops: ModuleType,
        max_position: int,
        parallel: ParallelContext = SINGLE_PROCESS,
    ) -> None:
        super().__init__()
        self.config = config
        self.plan_step = getattr(ops, "plan_step", None)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype, parallel=parallel
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, ops, parallel, index) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            parallel=parallel,
            tied_embedding=self.embed_tokens if config.tie_word_embeddings else None,
        )
        cos_sin = build_cos_sin_cache(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling
        )
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)
        self.one_token_forward: OneTokenForward | None = None

    def compile_one_token(self) -> None:
        """Runs later one-token steps through ``torch.compile`` (``engine/compiled_forward.py``);
        the next such step compiles, while the weights are still unpacked."""
        if self.plan_step is None:
            raise ValueError("the compiled forward needs the torch attention backend")
        self.one_token_forward = OneTokenForward(self._one_token_body)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        sample_rows: torch.Tensor,  # [num_sampled]
    ) -> torch.Tensor:
        plan = None
        if self.plan_step is not None:  # checked and indexed once for all layers
            plan = self.plan_step(
                positions,
                metadata.slot_mapping,
                metadata.query_start,
                metadata.context_lens,
                metadata.block_tables,
                self.cos_sin_cache,
                block_size=kv_cache.shape[3],
                num_kv_heads=kv_cache.shape[4],
                num_slots=kv_cache.shape[2] * kv_cache.shape[3],
            )
        if (
            self.one_token_forward is not None
            and input_ids.shape[0] == 1
            and sample_rows.shape[0] == 1
        ):
            try:
                return self.one_token_forward(plan, kv_cache, input_ids, plan.cos, plan.sin)
            except RuntimeError as error:
                if not is_recompile_error(error):
                    raise
                logger.error(
                    "compile: the one-token graph no longer applies (%s); the eager "
                    "forward serves every step from now on",
                    str(error).splitlines()[0],
                )
                self.one_token_forward = None
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            hidden, residual = layer(
                positions, hidden, residual, metadata, layer_cache, self.cos_sin_cache, plan
            )
        assert residual is not None
        # Only the sampling rows go through the final norm and the LM head.
        hidden, _ = self.norm(hidden[sample_rows], residual[sample_rows])
        return self.lm_head(hidden).float()  # [num_sampled, vocab_size]

    def _one_token_body(
        self,
        input_ids: torch.Tensor,  # [1]
        cos: torch.Tensor,  # [1, 1, head_dim] float32
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """The forward of one sampled token after ``plan_step``, as ``torch.compile`` traces
        it; returns its float32 logits [1, vocab_size]."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer.forward_compiled(hidden, residual, cos, sin)
        assert residual is not None
        hidden, _ = self.norm(hidden, residual)
        return self.lm_head(hidden).float()

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
        for checkpoint_name, tensor in weights:
            name, shard_id = self._param_name(checkpoint_name)
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

    def _param_name(self, checkpoint_name: str) -> tuple[str | None, int]:
        if "rotary_emb.inv_freq" in checkpoint_name:
            return None, 0
        name = checkpoint_name.removeprefix("model.")
        if name == "lm_head.weight":
            return (None, 0) if self.config.tie_word_embeddings else ("lm_head.weight", 0)
        for fragment, (fused, shard_id) in self._FUSED.items():
            if fragment in name:
                return name.replace(fragment, fused), shard_id
        return name, 0

    def _expected_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        keys = set()
        for name in params:
            if ".qkv_proj." in name:
                keys.update(f"{name}#{shard}" for shard in range(3))
            elif ".gate_up_proj." in name:
                keys.update(f"{name}#{shard}" for shard in range(2))
            else:
                keys.add(f"{name}#0")
        return keys
