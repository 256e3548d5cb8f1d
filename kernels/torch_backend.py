"""The PyTorch attention backend: the CPU serving path, and the reference of every Triton kernel.

One object, used in two phases per step (the shape of every backend, see ``kernels/__init__.py``):

    plan = backend.plan(positions, metadata, kv_cache, max_position)   # once: checks, indices
    rope = backend.rope(positions, cos_sin_cache)                       # once: rotary rows
    per layer: backend.rms_norm(...), backend.rotary(qk, rope),
               backend.attend(q, k, v, plan, layer, scale),             # K/V store + attention
               backend.silu_mul(gate_up)

The paged KV cache of a layer (one tensor for K, one for V), slot = block_id * block_size + offset:

    key_cache [num_blocks, block_size, num_kv_heads, head_dim]
    block_table [7, 2], block_size 4, context_len 6 -> positions 0..3 in block 7, 4..5 in block 2

``attend`` is the custom operator ``splitfuse::attend``: to ``torch.compile`` it is opaque, and the
step's plan, which also holds the KV cache, is a reference-type opaque object, so a compiled graph
neither specializes on a step's rows nor copies the cache it writes. Everything else here is plain
tensor math that the compiler traces and fuses.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

import kernels.torch_moe  # noqa: F401 (registers the operator splitfuse::moe_experts)
from kernels.checks import (
    KernelInputError,
    check_attention_inputs,
    check_kv_cache,
    check_kv_inputs,
    check_metadata,
)
from kernels.metadata import AttentionMetadata
from kernels.torch_attention import AttentionPlan, paged_attention, plan_paged_attention

__all__ = ["OperatorStep", "TorchBackend", "TorchStepPlan"]


class OperatorStep(NamedTuple):
    """A step as tensors alone: what a graph that inductor's C++ wrapper runs takes for a plan
    (``TorchBackend.operator_step``). Its layers then call ``splitfuse_cpu::store_and_attend_step``
    themselves (decode tokens through the fixed-order kernel, prompt chunks through SDPA, in
    C++), so the whole graph runs without Python.

    A step of several tokens holds at least two rows (an empty one added to a single prompt,
    ``query_start`` [0, n, n]) and every step at least two table columns: a graph traced over
    a dimension of size 1 specializes it, and would serve no other step."""

    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1: not stored
    block_tables: torch.Tensor  # [num_rows, >= 2 blocks] int32, contiguous
    query_start: torch.Tensor  # [num_rows + 1] int32
    context_lens: torch.Tensor  # [num_rows] int32


class TorchStepPlan(OpaqueBase):
    """A step's checked metadata in the form every layer uses (``TorchBackend.plan``)."""

    def __init__(
        self,
        attention: AttentionPlan,
        store_slots: torch.Tensor,  # [num_stored] int64 cache slots of the stored tokens
        store_tokens: torch.Tensor | None,  # [num_stored] their token indices; None: every token
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1: not stored
        metadata: AttentionMetadata | None = None,  # given: the step has a tensor form
    ) -> None:
        self.attention = attention
        self.store_slots = store_slots
        self.store_tokens = store_tokens
        self.kv_cache = kv_cache
        self.slot_mapping = slot_mapping
        # the C++ operator attends every token (a decode step): each layer is then one call
        # that also stores, even eagerly
        kernel = attention.kernel_tokens
        self.fused = kernel is not None and kernel.tokens == slice(0, attention.num_tokens)
        self.operator_step: OperatorStep | None = None
        if metadata is not None and attention.num_tokens:
            self.operator_step = _operator_step(kv_cache, slot_mapping, metadata)


register_opaque_type(TorchStepPlan, typ="reference")


class TorchBackend:
    name = "torch"

    def __init__(self, deterministic: bool = False, cpu_kernel: bool | None = None) -> None:
        """``deterministic``: attention in a fixed order whatever the batch.

        ``cpu_kernel``: on CPUs, the C++ operator ``splitfuse_cpu::fixed_order_attention``
        (``kernels/cpu_ops.py``) attends every token in deterministic mode and the decode tokens
        otherwise; False: PyTorch alone (SDPA, and in deterministic mode products in a fixed
        order, ``kernels/torch_attention.py``, as on GPUs or without a C++ compiler); None: the
        operator where it builds."""
        self.deterministic = deterministic
        if cpu_kernel is None:
            from kernels.cpu_ops import has_fixed_order_attention

            cpu_kernel = has_fixed_order_attention()
        self.cpu_kernel = cpu_kernel
        # the norms, rotary and SiLU as the decode stack computes them (``_row_ops``); the runner
        # keeps them where the stack's products are the operators' own (4-bit weights), so that
        # a decode token gets the same bits from both, and leaves them to PyTorch (and inductor's
        # fused loops) elsewhere: bfloat16 prefill ~5% faster there
        self.row_ops = True

    def plan(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        max_position: int,
    ) -> TorchStepPlan:
        """Checks a step's metadata (shapes and values: positions below ``max_position``, slots
        inside the cache, row lengths; raises KernelInputError, changing nothing) and works out
        what every layer reuses. One host read of the metadata per step."""
        check_kv_cache(kv_cache)
        check_metadata(positions, metadata, kv_cache.device)
        num_tokens = positions.shape[0]
        block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
        num_slots = kv_cache.shape[2] * block_size
        slot_mapping = metadata.slot_mapping
        store_slots, store_tokens = slot_mapping, None
        if num_tokens:
            min_position, max_pos = (int(p) for p in positions.aminmax())
            if min_position < 0 or max_pos >= max_position:
                raise KernelInputError(f"positions must be in [0, {max_position})")
            min_slot, max_slot = (int(slot) for slot in slot_mapping.aminmax())
            if min_slot < -1 or max_slot >= num_slots:
                raise KernelInputError(f"slot_mapping must hold -1 or slots in [0, {num_slots})")
            if min_slot == -1:  # padding tokens
                store_tokens = (slot_mapping >= 0).nonzero().squeeze(1)
                store_slots = slot_mapping[store_tokens]
        attention = plan_paged_attention(
            metadata.query_start,
            metadata.context_lens,
            metadata.block_tables,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            num_tokens=num_tokens,
            deterministic=self.deterministic,
            cpu_kernel=self.cpu_kernel and kv_cache.device.type == "cpu",
        )
        # the tensor form needs the C++ operator, and deterministic mode's order of prompt
        # tokens (not SDPA's)
        tensor_form = self.cpu_kernel and not self.deterministic and kv_cache.device.type == "cpu"
        return TorchStepPlan(
            attention,
            store_slots,
            store_tokens,
            kv_cache,
            slot_mapping,
            metadata if tensor_form else None,
        )

    def operator_step(self, plan: TorchStepPlan) -> OperatorStep | None:
        """The step as tensors alone where the C++ operator attends it (on CPUs, outside
        deterministic mode), else None: the plan of the graphs that inductor's C++ wrapper
        runs."""
        return plan.operator_step

    def rope(
        self,
        positions: torch.Tensor,  # [num_tokens] int64, checked by ``plan``
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos half, sin half
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary rows of the step's tokens: (cos, sin), each [num_tokens, 1, head_dim]
        float32, cos twice and (-sin, sin), so that ``rotary`` is two products and a sum."""
        half = cos_sin_cache.shape[1] // 2
        cos_sin = cos_sin_cache.index_select(0, positions)[:, None, :]
        cos, sin = cos_sin[..., :half], cos_sin[..., half:]
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def rotary(
        self,
        heads: torch.Tensor,  # [num_tokens, num_heads, head_dim]: query and key heads
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Rotary embedding (Llama / GPT-NeoX rotate_half layout), in float32, returned in
        ``heads``' dtype: x * cos + rotate_half(x) * sin, where rolling x by half a head turns
        [x1, x2] into [x2, x1] and (-sin, sin) finishes rotate_half."""
        cos, sin = rope
        if self._row_ops(heads):
            return torch.ops.splitfuse_cpu.rotary_rows(heads, cos, sin)
        x = heads.float()
        rotated = x * cos + torch.roll(x, heads.shape[-1] // 2, -1) * sin
        return rotated.to(heads.dtype)

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        plan: TorchStepPlan,
    ) -> None:
        """Writes each token's K/V into its cache slot (tokens whose slot is -1 are skipped),
        rounded to the cache's dtype. Checked: bad tensors raise KernelInputError and write
        nothing."""
        check_kv_inputs(key, value, key_cache, value_cache, converts=True)
        _store_kv(key, value, key_cache, value_cache, plan)

    def paged_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        plan: TorchStepPlan,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of the step's rows over the cache (``kernels/torch_attention.py``),
        in the query's dtype whatever the cache's. Checked: bad tensors raise KernelInputError
        and write nothing."""
        check_attention_inputs(query, key_cache, value_cache, out, converts=True)
        return paged_attention(query, key_cache, value_cache, plan.attention, scale, out)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        plan: TorchStepPlan | OperatorStep,
        layer: int,
        scale: float,
    ) -> torch.Tensor:
        """Stores the layer's K/V and returns the attention of ``query`` [num_tokens, num_heads,
        head_dim] over the layer's cache."""
        if isinstance(plan, OperatorStep):  # a graph's plan: the operator called directly
            key, value = key.to(plan.kv_cache.dtype), value.to(plan.kv_cache.dtype)
            query, key, value = (_heads_rows(t) for t in (query, key, value))
            return _store_and_attend_step(query, key, value, plan, layer, scale)
        return torch.ops.splitfuse.attend(query, key, value, plan, layer, scale)

    def rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s) * weight, s)`` with ``s = x + residual`` (``s = x`` without one): the sum
        in x.dtype, normalized in float32, rounded to x.dtype, then scaled by the weight (the
        Hugging Face Llama order). ``s`` is the next layer's residual. Unchecked: for the
        model's own tensors (a mismatched residual fails in the sum)."""
        if self._row_ops(x) and (residual is None or residual.dtype == x.dtype):
            normed, summed = torch.ops.splitfuse_cpu.rms_norm_rows(
                x.contiguous(), weight, eps, None if residual is None else residual.contiguous()
            )
            return normed, x if residual is None else summed
        summed = x if residual is None else x + residual
        normed = F.rms_norm(summed.float(), (x.shape[-1],), eps=eps)  # x * rsqrt(mean(x^2) + eps)
        return normed.to(x.dtype) * weight.to(x.dtype), summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` of ``gate_up`` [num_tokens, 2 * intermediate] (gate, then
        up), in its dtype: silu rounded to it, then the product."""
        if self._row_ops(gate_up):
            return torch.ops.splitfuse_cpu.silu_mul_rows(gate_up.contiguous())
        intermediate = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]

    def silu_mul_product(self, layer: Any, x: torch.Tensor) -> torch.Tensor | None:
        """``silu_mul(layer(x))`` of a gate-and-up layer in one C++ call where the layer's
        weights have one (``silu_mul_product`` of ``engine/layers.py``: 4-bit CPU weights where
        the row operators run, ``_row_ops``; bfloat16 ones on AMX tiles), the row operators'
        SiLU. None elsewhere."""
        if x.device.type != "cpu" or not self.cpu_kernel:
            return None
        act: torch.Tensor | None = layer.silu_mul_product(x, row_ops=self._row_ops(x))
        return act

    def _row_ops(self, x: torch.Tensor) -> bool:
        """Whether the norms, rotary and SiLU of ``x``'s rows run the C++ operators
        ``rms_norm_rows``, ``rotary_rows`` and ``silu_mul_rows`` (``kernels/cpu_ops.py``): the
        decode stack's own arithmetic, so that a decode token's numbers do not depend on which
        of the two computes its step; float32 and bfloat16 on CPUs where they are built, unless
        ``row_ops`` is off."""
        return (
            self.row_ops
            and self.cpu_kernel
            and x.device.type == "cpu"
            and (x.dtype == torch.float32 or x.dtype == torch.bfloat16)
        )

    def moe_experts(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        w_gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
        w_down: torch.Tensor,  # [num_experts, hidden, intermediate]
        topk_weights: torch.Tensor,  # [num_tokens, top_k], hidden's dtype
        topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    ) -> torch.Tensor:
        """The routed experts' weighted SwiGLU, summed per token (``kernels/torch_moe.py``): the
        operator ``splitfuse::moe_experts``, unchecked (the model's own tensors)."""
        return torch.ops.splitfuse.moe_experts(hidden, w_gate_up, w_down, topk_weights, topk_ids)


def _operator_step(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, metadata: AttentionMetadata
) -> OperatorStep:
    """The step's ``OperatorStep``: its metadata, a single row of several tokens given an empty
    second row, the tables at least two blocks wide."""
    tables, query_start, context_lens = (
        metadata.block_tables,
        metadata.query_start,
        metadata.context_lens,
    )
    if tables.shape[0] == 1 and slot_mapping.shape[0] > 1:
        tables = F.pad(tables, (0, 0, 0, 1))
        query_start = torch.cat((query_start, query_start[-1:]))
        context_lens = F.pad(context_lens, (0, 1))
    if tables.shape[1] < 2:
        tables = F.pad(tables, (0, 2 - tables.shape[1]))
    return OperatorStep(
        kv_cache, slot_mapping, tables.contiguous(), query_start.contiguous(), context_lens
    )


def _store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: TorchStepPlan,
) -> None:
    if key.shape[0] != plan.attention.num_tokens:
        raise KernelInputError(f"key/value {tuple(key.shape)} do not match the step's plan")
    if plan.store_tokens is not None:
        key, value = key[plan.store_tokens], value[plan.store_tokens]
    # rounded to a cache of another dtype
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    slot_shape = (-1, *key_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim] views
    if key_cache.element_size() == 1:  # float8: copied as their bytes (no index_copy_ for it)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    key_cache.view(slot_shape).index_copy_(0, plan.store_slots, key)
    value_cache.view(slot_shape).index_copy_(0, plan.store_slots, value)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: TorchStepPlan,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """The model's own tensors, unchecked per layer (``plan`` checked the step)."""
    step = plan.operator_step
    # rounded to a cache of another dtype (then contiguous heads: the fused call takes them)
    key, value = key.to(plan.kv_cache.dtype), value.to(plan.kv_cache.dtype)
    if step is not None and plan.fused and _heads_contiguous(query, key, value):
        return _store_and_attend_step(query, key, value, step, layer, scale)
    key_cache, value_cache = plan.kv_cache[layer]
    _store_kv(key, value, key_cache, value_cache, plan)
    return paged_attention(query, key_cache, value_cache, plan.attention, scale)


def _store_and_attend_step(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], heads contiguous
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], heads contiguous, cache dtype
    value: torch.Tensor,
    step: OperatorStep,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """One C++ call: stores the layer's K/V into the step's slots and attends every token."""
    return torch.ops.splitfuse_cpu.store_and_attend_step(
        query,
        key,
        value,
        step.kv_cache,
        layer,
        step.slot_mapping,
        step.block_tables,
        step.query_start,
        step.context_lens,
        scale,
    )


def _heads_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its heads as contiguous rows (a copy only where they are not)."""
    return tensor if _heads_contiguous(tensor) else tensor.contiguous()


def _heads_contiguous(*tensors: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] views whose heads are contiguous rows (what the model's fused
    projections give), as ``store_and_attend_step`` reads them."""
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors)


def _attend_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: TorchStepPlan,
    layer: int,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


# The low-level library API: torch.library.custom_op's Python wrapper costs ~90 us a call, more
# than the attention of a short decode. The K/V write goes to the plan's cache, outside any graph.
_LIBRARY = torch.library.Library("splitfuse", "FRAGMENT")
_LIBRARY.define(
    "attend(Tensor query, Tensor key, Tensor value, kernels.torch_backend.TorchStepPlan plan, "
    "int layer, float scale) -> Tensor"
)
_LIBRARY.impl("attend", _attend, "CPU")
_LIBRARY.impl("attend", _attend, "CUDA")
_LIBRARY.impl("attend", _attend_shape, "Meta")
