"""The one-token forward under ``torch.compile``: a single request decoding, on a CPU.

A one-token decode step of the default model runs ~5,000 small operators in eager mode, and on two
cores their dispatch costs about as much as the matrix products; the products themselves (oneDNN,
one row) read the weights at about half the memory bandwidth. Compiled, inductor fuses each layer's
norms, rotary and SwiGLU into a few C++ loops, and its C++ GEMM template (``max_autotune`` with the
CPP backend) turns every one-row product into a loop over weights packed once as constants
(``freezing``). Measured on the default model, bfloat16, 2 cores: forward ~30 ms -> ~14 ms.

    eager:    plan_step (checks, gather indices, rotary angles)
    compiled: embed -> [RMSNorm -> qkv -> rotary -> splitfuse::attend_step -> o_proj -> RMSNorm
                        -> gate_up -> SiLU * up -> down] x num_layers -> RMSNorm -> LM head

``splitfuse::attend_step(q, k, v, layer, scale)`` stores the layer's K/V into the paged cache and
attends with the step's plan. The plan and the KV cache never enter the graph: the op reads them
from the step context that ``OneTokenForward`` sets around the call, so a new context length is
not a new graph, and the cache, which the op writes in place, is never copied by the compiler's
functionalization. To the compiler the op is a pure function of (q, k, v); its write goes to state
outside the graph, and its output is always used, so it runs exactly once per layer, in order.

Every other step (prompt chunks, several requests) runs the eager forward: at many rows the
products dominate and oneDNN's packed products are already good there. The shape is static (one
token), so the graph is compiled once, at start-up (``ModelRunner``), about a minute for the
default model on 2 cores. Weight guards are skipped (the weights never change after loading), so a
call costs no check per parameter.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from kernels import torch_ops

_step = threading.local()


def attend_step(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    layer: int,
    scale: float,
) -> torch.Tensor:
    """Stores ``key``/``value`` into layer ``layer``'s cache and returns the paged attention of
    ``query`` [num_tokens, num_heads, head_dim], with the plan and cache of the current step."""
    plan, kv_cache = _current_step()
    key_cache, value_cache = kv_cache[layer]
    torch_ops.store_kv_planned(key, value, key_cache, value_cache, plan)
    return torch_ops.paged_attention_planned(query, key_cache, value_cache, plan.attention, scale)


def _attend_step_shape(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


# The low-level library API: torch.library.custom_op's Python wrapper costs ~90 us a call, more
# than the attention of a short decode.
_LIBRARY = torch.library.Library("splitfuse", "DEF")
_LIBRARY.define(
    "attend_step(Tensor query, Tensor key, Tensor value, int layer, float scale) -> Tensor"
)
_LIBRARY.impl("attend_step", attend_step, "CPU")
_LIBRARY.impl("attend_step", _attend_step_shape, "Meta")

# Dynamo reads the freezing switch from the global config when it traces (it must see the weights
# as constants to hand them to inductor); patched around our calls alone.
_FREEZING = torch._inductor.config.patch(freezing=True)

_OPTIONS: dict[str, Any] = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",  # no benchmarking against ATen: one choice per product
    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
}


def _current_step() -> tuple[Any, torch.Tensor]:
    current = getattr(_step, "current", None)
    if current is None:
        raise RuntimeError("splitfuse::attend_step runs only inside a OneTokenForward call")
    return current


def compile_unsupported(device: torch.device, attention_backend: str, world_size: int) -> str:
    """Why the compiled forward cannot run here ('' when it can)."""
    if device.type != "cpu":
        return "it is built for CPUs"
    if attention_backend != "torch":
        return "it needs the torch attention backend"
    if world_size > 1:
        return "tensor-parallel ranks run the eager forward"
    return ""


def compile_forward(body: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``body`` (a bound method of the model) compiled for static one-token inputs.

    Dynamo keeps its compiled graphs on the function's code object, and with the weight guards
    skipped, a second model in the process would run the first one's graph (its frozen weights).
    Each model therefore compiles its own copy of the code object; the graph, and the weight
    constants in it, go away with the model."""
    assert isinstance(body, types.MethodType), "compile_forward takes a bound method"
    function = body.__func__
    fresh = types.FunctionType(
        function.__code__.replace(),  # an equal but distinct code object
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return torch.compile(types.MethodType(fresh, body.__self__), dynamic=False, options=_OPTIONS)


class OneTokenForward:
    """``model._one_token_body`` compiled; called as ``(plan, kv_cache, input_ids, cos, sin)``.

    The first call compiles. Later calls must not compile again (a recompile would trace the
    model after ``pack_weights`` replaced its weights): they run under the ``fail_on_recompile``
    stance, and ``is_recompile_error`` tells that failure from the step's own errors."""

    def __init__(self, body: Callable[..., torch.Tensor]) -> None:
        self._compiled = compile_forward(body)
        self.ready = False

    def __call__(self, plan: Any, kv_cache: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        _step.current = (plan, kv_cache)
        try:
            with (
                _FREEZING,
                torch.compiler.set_stance("fail_on_recompile" if self.ready else "default"),
            ):
                logits = self._compiled(*args)
        finally:
            _step.current = None
        self.ready = True
        return logits


def is_recompile_error(error: BaseException) -> bool:
    """Whether ``error`` is dynamo refusing to recompile a ready ``OneTokenForward`` (raised
    before the graph ran: nothing of the step was computed)."""
    return isinstance(error, RuntimeError) and str(error).startswith("Detected recompile")
