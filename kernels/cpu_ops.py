"""The C++ CPU operators of ``kernels/cpu/``, built by torch's extension builder (once; ``make
install`` builds them, later imports load the cached library):

- ``splitfuse_cpu::quant_linear``, ``int4_linear`` and ``int8_linear``, the weight-only
  quantized products (8-bit, 4-bit, and 8-bit packed as the 4-bit ones), with PyTorch fallbacks
  where no C++ compiler is there;
- ``splitfuse_cpu::fixed_order_attention``, attention over the paged cache in a fixed order:
  deterministic mode's, and the default mode's for decode tokens (``kernels/torch_attention.py``;
  without a compiler, SDPA and, in deterministic mode, PyTorch products in a fixed order
  instead: ``has_fixed_order_attention``);
- ``splitfuse_cpu::store_and_attend_step``, one layer's store and attention of a whole step,
  prompt chunks and decodes, from tensors alone, for a compiled graph to call (built with the
  fixed-order operators: ``has_fixed_order_attention``);
- ``splitfuse_cpu::blocked_linear``, the product of a few bfloat16 rows with a weight in oneDNN's
  blocked layout, on CPUs with AVX-512 BF16, and of every row count on AMX tiles where the CPU
  has them (``engine/packed_linear.py``; elsewhere, or without a compiler, oneDNN runs every
  product: ``has_blocked_linear``), and ``blocked_silu_mul(x, weight, intermediate)``, SwiGLU's
  ``silu_mul_rows(blocked_linear(x, weight))`` of a gate-and-up weight in one parallel region,
  the same bits (its speed: kernels/cpu/decode_stack.cpp);
- ``splitfuse_cpu.GraphCall``, a class that calls a graph compiled under inductor's C++ wrapper
  through its entry point, holding the arguments that never change (``engine/step_graphs.py``);
- ``splitfuse_cpu::greedy_argmax``, torch's argmax of float32 rows in one vectorized call
  (greedy sampling, ``engine/sampler.py``; without a compiler the sampler calls torch's);
- ``splitfuse_cpu.DecodeStack``, a class that runs a decode step of a Llama stack with 4-bit or
  blocked bfloat16 weights, every layer in one parallel region, with the kernels of the
  operators above (``engine/decode_stack.py``), and its norm, rotary and SiLU as the operators
  ``rms_norm_rows``, ``rotary_rows`` and ``silu_mul_rows``, which the forward of a 4-bit model
  calls on CPUs (``kernels/torch_backend.py``), so that a decode token gets the same bits
  either way.

``quant_linear(x, qweight, scales, group_size)``: x [M, K] float32 or bfloat16 times an 8-bit
weight [N, K] (layouts in ``engine/quantization.py``), dequantized and transposed -> [M, N] float32.
float32 sums of exact products, except for bfloat16 rows (more than one) on CPUs with AVX-512
BF16: there the weight is rounded to bfloat16 (what a bfloat16 copy of the float weight holds)
and multiplied in hardware.

``int4_linear(x, packed, scales, mins, out_features, group_size, round_to_x=False)``: x times a
4-bit weight packed as ``PackedInt4`` -> [M, N] float32 (``round_to_x``: in x's dtype, the same
bits as the float32 result's ``.to(x.dtype)``, without writing it); x is rounded to int8 in
runs of 32 first (``quantize_activations``) and the 4-bit values multiply it in int32 sums
(``int4_linear_reference`` is what it computes). On CPUs with AMX-BF16 (``has_int4_tiles``) a
step's prompt tokens may go on AMX tiles instead, x and the weight's values rounded to bfloat16
(``int4_tiles_reference``): ``int4_tile_rows(row)`` says from which row on, for the calls of the
thread inside it.

``int4_silu_mul(x, packed, scales, mins, intermediate, group_size)``: SwiGLU's ``silu(gate) * up``
of x times a gate-and-up 4-bit weight (the gate's ``intermediate`` outputs first) in x's dtype,
float32 or bfloat16: ``silu_mul_rows(int4_linear(...).to(x.dtype))``, the same bits, in one
parallel region whose products stay in the threads' caches (a prompt chunk's gate and up: 1.38
-> 1.18 ms).

``int8_linear(x, packed, scales, out_features, group_size)``: the same for an 8-bit weight
packed as ``PackedInt8`` (the embedding and LM head of a model whose products run
``int4_linear``).

``store_and_attend_step(query, key, value, kv_cache, layer, slots, block_tables, query_start,
context_lens, scale)``: writes token t's K/V into slot slots[t] (-1: not stored) of layer
``layer`` of kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], then
returns the causal attention of the step's rows over it, [num_tokens, num_heads, head_dim] in the
query's dtype: row r's tokens query_start[r] .. query_start[r + 1] - 1 sit at the last q_len of
its context_lens[r] positions, read through row r of block_tables. Decode rows go to the
fixed-order kernel, all in one call; each prompt chunk gathers its context and calls SDPA (by
query chunks of 64 from 128 tokens on, as ``kernels/torch_attention.py``, except for a chunk
with nothing cached before it where torch's flash kernel multiplies on AMX tiles: one causal
call; ``attends_whole(dtype)`` says where, for the eager path to decide alike). bfloat16 prompt
chunks with heads of 64 attend through our own kernel instead where the CPU runs it
(``prompt_kernel``: on AMX tiles, ``kernels/cpu/prompt_attention_amx.cpp``, or with AVX-512 BF16,
``kernels/cpu/prompt_attention_avx512.cpp``; a token's result the same bits however its prompt is
chunked), and ``prompt_attention(query, key_rows, value_rows, slots, scale)`` gives the eager
path that same kernel for one chunk. Every input is checked before the cache is written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
_EXTENSION = "splitfuse_cpu_kernels"
_lock = threading.Lock()
_state: dict[str, object] = {}


_SOURCES = (
    "quant_linear.cpp",
    "fixed_order_attention.cpp",
    "ragged_attention.cpp",
    "blocked_linear.cpp",
    "int4_linear.cpp",
    "int4_amx.cpp",
    "prompt_attention_amx.cpp",
    "prompt_attention_avx512.cpp",
    "graph_call.cpp",
    "decode_stack.cpp",
    "greedy_argmax.cpp",
)
_CFLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp")
# A build takes 1.5-3 minutes on 2 cores: a build lock older than this was left by a process
# that died while it held it
_STALE_LOCK_SECONDS = 20 * 60


def _stamp() -> str:
    """What the library is built from: every source and header of ``kernels/cpu/``, the flags and
    torch's version."""
    digest = hashlib.sha256(repr((_CFLAGS, torch.__version__)).encode())
    for path in sorted(_SOURCE_DIR.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_directory() -> Path:
    """The folder torch's extension builder builds and caches the library in (its lock file and
    our stamp lie there too)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(_EXTENSION, verbose=False))


def _build() -> str:
    """Builds (or loads the cached build of) the C++ operator; returns the instruction set it runs
    with. Raises where it cannot be built.

    A library built from these very sources (its stamp says so, written after it: a library
    rebuilt since by another checkout sharing the folder is newer) is loaded directly. torch's
    builder takes a lock file in the build folder even to find that nothing needs building, and
    a process killed while it holds it (a server stopped during start-up) leaves it there: every
    later start would wait on it forever. Where a build is needed, a lock older than any build
    is removed first."""
    from torch.utils import cpp_extension

    directory = build_directory()
    library = directory / f"{_EXTENSION}.so"
    stamp_path = directory / "splitfuse.stamp"
    stamp = _stamp()
    if (
        library.is_file()
        and stamp_path.is_file()
        and stamp_path.stat().st_mtime >= library.stat().st_mtime
        and stamp_path.read_text() == stamp
    ):
        torch.ops.load_library(str(library))
        return str(torch.ops.splitfuse_cpu.instruction_set())
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        age = 0.0
    if age > _STALE_LOCK_SECONDS:
        logger.warning("removing a build lock left %.0f minutes ago: %s", age / 60, lock)
        lock.unlink(missing_ok=True)
    cpp_extension.load(
        name=_EXTENSION,
        sources=[str(_SOURCE_DIR / name) for name in _SOURCES],
        extra_include_paths=[str(_SOURCE_DIR)],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=[],
        is_python_module=False,
        verbose=os.environ.get("SPLITFUSE_VERBOSE_BUILD") == "1",
    )
    written = stamp_path.with_name(f"{stamp_path.name}.{os.getpid()}")
    written.write_text(stamp)
    os.replace(written, stamp_path)  # (readers see the old stamp or the new one, whole)
    return str(torch.ops.splitfuse_cpu.instruction_set())


def _define_fallback() -> None:
    """The same operators in PyTorch (dequantize, then ``F.linear``)."""
    from engine.quantization import (
        PackedInt4,
        PackedInt8,
        dequantize_groups,
        int4_linear_reference,
    )

    library = torch.library.Library("splitfuse_cpu", "DEF")
    _state["library"] = library  # kept alive: the definitions live as long as the object
    library.define(
        "quant_linear(Tensor x, Tensor qweight, Tensor scales, int group_size) -> Tensor"
    )

    def quant_linear(x, qweight, scales, group_size):  # type: ignore[no-untyped-def]
        weight = dequantize_groups(qweight, scales, None, 8, group_size)
        return torch.nn.functional.linear(x.float(), weight)

    library.impl("quant_linear", quant_linear, "CPU")
    library.define(
        "int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int out_features, "
        "int group_size, bool round_to_x=False) -> Tensor"
    )

    def int4_linear(x, packed, scales, mins, out_features, group_size, round_to_x=False):  # type: ignore[no-untyped-def]
        weight = PackedInt4(packed, scales, mins, out_features, group_size)
        out = int4_linear_reference(x, weight)
        return out.to(x.dtype) if round_to_x else out

    library.impl("int4_linear", int4_linear, "CPU")
    library.define(
        "int8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, int group_size) "
        "-> Tensor"
    )

    def int8_linear(x, packed, scales, out_features, group_size):  # type: ignore[no-untyped-def]
        return int4_linear_reference(x, PackedInt8(packed, scales, out_features, group_size))

    library.impl("int8_linear", int8_linear, "CPU")


def load() -> str:
    """Makes ``torch.ops.splitfuse_cpu.quant_linear`` (and the others) available; returns what
    runs the 8-bit product:
    "avx512_bf16", "avx512", "avx2" or "sse2" (the C++ operator) or "torch" (the fallback)."""
    with _lock:
        if "kind" in _state:
            return str(_state["kind"])
        try:
            kind = _build()
        except Exception as error:  # no compiler, no headers: the fallback keeps things working
            logger.warning(
                "the C++ CPU operators could not be built (%s); quantized products and "
                "deterministic attention use PyTorch",
                error,
            )
            _define_fallback()
            kind = "torch"

        @torch.library.register_fake("splitfuse_cpu::quant_linear")
        def _fake(x, qweight, scales, group_size):  # type: ignore[no-untyped-def]
            return x.new_empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)

        @torch.library.register_fake("splitfuse_cpu::int4_linear")
        def _fake_int4(x, packed, scales, mins, out_features, group_size, round_to_x=False):  # type: ignore[no-untyped-def]
            dtype = x.dtype if round_to_x else torch.float32
            return x.new_empty((x.shape[0], out_features), dtype=dtype)

        @torch.library.register_fake("splitfuse_cpu::int8_linear")
        def _fake_int8(x, packed, scales, out_features, group_size):  # type: ignore[no-untyped-def]
            return x.new_empty((x.shape[0], out_features), dtype=torch.float32)

        if kind != "torch":

            @torch.library.register_fake("splitfuse_cpu::fixed_order_attention")
            def _fake_attention(query, key_cache, value_cache, tables, rows, lens, scale):  # type: ignore[no-untyped-def]
                return query.new_empty(query.shape)

            @torch.library.register_fake("splitfuse_cpu::store_and_attend_step")
            def _fake_store_and_attend_step(query, key, value, kv_cache, layer, *args):  # type: ignore[no-untyped-def]
                return query.new_empty(query.shape)

            @torch.library.register_fake("splitfuse_cpu::prompt_attention")
            def _fake_prompt_attention(query, key_rows, value_rows, slots, scale):  # type: ignore[no-untyped-def]
                return query.new_empty(query.shape)

            @torch.library.register_fake("splitfuse_cpu::greedy_argmax")
            def _fake_greedy_argmax(logits):  # type: ignore[no-untyped-def]
                return logits.new_empty((logits.shape[0],), dtype=torch.int64)

            @torch.library.register_fake("splitfuse_cpu::rms_norm_rows")
            def _fake_rms_norm_rows(x, weight, eps, residual):  # type: ignore[no-untyped-def]
                return x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,))

            @torch.library.register_fake("splitfuse_cpu::rotary_rows")
            def _fake_rotary_rows(heads, cos, sin):  # type: ignore[no-untyped-def]
                return heads.new_empty(heads.shape)

            @torch.library.register_fake("splitfuse_cpu::silu_mul_rows")
            def _fake_silu_mul_rows(gate_up):  # type: ignore[no-untyped-def]
                return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

            @torch.library.register_fake("splitfuse_cpu::int4_silu_mul")
            def _fake_int4_silu_mul(x, packed, scales, mins, intermediate, group_size):  # type: ignore[no-untyped-def]
                return x.new_empty((x.shape[0], intermediate))

            @torch.library.register_fake("splitfuse_cpu::blocked_silu_mul")
            def _fake_blocked_silu_mul(x, weight, intermediate):  # type: ignore[no-untyped-def]
                return x.new_empty((x.shape[0], intermediate))

            @torch.library.register_fake("splitfuse_cpu::blocked_linear")
            def _fake_blocked_linear(x, weight, bias):  # type: ignore[no-untyped-def]
                return x.new_empty((x.shape[0], weight.shape[0] * weight.shape[2]))

        _state["kind"] = kind
        return kind


def has_blocked_linear() -> bool:
    """Whether ``torch.ops.splitfuse_cpu.blocked_linear`` runs here: the C++ operators are built
    and run with AVX-512 BF16 (``SPLITFUSE_CPU_ISA`` below that turns it off too)."""
    return load() == "avx512_bf16"


@functools.cache
def attends_whole(dtype: torch.dtype) -> bool:
    """Whether a prompt chunk with nothing cached before it attends in one causal call, not in
    query chunks, as ``store_and_attend_step`` decides: where torch's CPU flash kernel
    multiplies ``dtype`` on AMX tiles (False where the operators are not built)."""
    if dtype not in (torch.bfloat16, torch.float16) or load() == "torch":
        return False
    return bool(torch.ops.splitfuse_cpu.attends_whole(dtype))


@functools.cache
def prompt_kernel(head_dim: int) -> str:
    """Which kernel of our own bfloat16 prompt chunks with heads of ``head_dim`` values attend
    with here (``store_and_attend_step``, and ``prompt_attention`` for the eager path): "amx"
    where the CPU has AMX-BF16 and the OS lends the tiles, "avx512_bf16" where it has AVX-512
    BF16 instead, "" where neither runs (the C++ operators not built, head_dim not 64, or
    ``SPLITFUSE_CPU_ISA`` set to anything but avx512_bf16, which asks for the AVX-512 one
    even where tiles are lent): SDPA then."""
    if load() == "torch":
        return ""
    return str(torch.ops.splitfuse_cpu.prompt_kernel(head_dim))


def has_int4_tiles() -> bool:
    """Whether ``int4_linear`` multiplies prompt rows on AMX tiles here (``int4_tile_rows``):
    the C++ operators are built, the CPU has AMX-BF16, the OS lends the tiles and
    ``SPLITFUSE_CPU_ISA`` is not set."""
    return load() != "torch" and bool(torch.ops.splitfuse_cpu.int4_tiles())


@contextlib.contextmanager
def int4_tile_rows(row: int | None) -> Iterator[None]:
    """Inside it, the ``int4_linear`` calls of this thread multiply their rows from ``row`` on
    (a step's prompt tokens) on AMX tiles, where ``has_int4_tiles()``; None: every row as
    before. The setting before it comes back after it."""
    if row is None or load() == "torch":
        yield
        return
    before = torch.ops.splitfuse_cpu.set_int4_tile_from(row)
    try:
        yield
    finally:
        torch.ops.splitfuse_cpu.set_int4_tile_from(before)


def has_fixed_order_attention() -> bool:
    """Whether ``torch.ops.splitfuse_cpu.fixed_order_attention`` is there (builds or loads the
    operators on the first call)."""
    return load() != "torch"


if __name__ == "__main__":  # ``python -m kernels.cpu_ops``: build at install time
    print(f"splitfuse_cpu::quant_linear runs with {load()}")
