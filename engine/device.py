"""Device, dtype and attention-backend choices from the configuration's ``auto`` values."""

from __future__ import annotations

import ctypes
import functools
import gc
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a KV cache's: the activations' dtypes, and float8 e4m3fn under vLLM's name too ("fp8")
KV_CACHE_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}
# CPU flags under which bfloat16 matrix products run in hardware (AMX tiles or AVX-512 BF16)
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but no CUDA GPU is available")
    return torch.device(name)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_code_tag() -> str:
    """A name for the machine code this process compiles for its CPU, e.g.
    ``x86_64-avx512-1f0c2a9b``: the architecture, torch's vector capability (the widest the CPU
    has, or what ``ATEN_CPU_CAPABILITY`` caps it to) and a hash of both with the CPU's flags.
    Inductor builds its C++ for the vector width it picked and with ``-march=native``, but keys
    its on-disk caches by neither: code read back on another CPU kind (a cache volume that
    follows a pod to another node, or the same machine run with another capability) runs
    vectors of the wrong width (writes past its buffers) or instructions the CPU lacks. Caches
    kept under this name are shared only by machines that compile the same code."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    identity = " ".join([platform.machine(), capability, *sorted(cpu_flags())])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return f"{platform.machine()}-{capability}-{digest}"


@functools.lru_cache(maxsize=1)
def cpu_runs_bf16() -> bool:
    """bfloat16 matrix products run in hardware here: the CPU has AMX or AVX-512 BF16, and
    oneDNN packs a bfloat16 weight (it refuses where its ISA is limited below those, e.g. by
    ``ONEDNN_MAX_CPU_ISA``; bfloat16 would then be emulated, several times slower)."""
    if not cpu_flags() & set(BF16_CPU_FLAGS) or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on GPUs and on CPUs that run it in hardware, else float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_runs_bf16() else torch.float32


def resolve_kv_cache_dtype(
    name: str, dtype: torch.dtype, device: torch.device, attention_backend: str, quantized: bool
) -> torch.dtype:
    """The KV cache's dtype. ``auto`` -> the activations' ``dtype``, but float16 on a CPU where
    they are float32 and the weights quantized (a CPU without bfloat16 hardware) under the
    torch backend: there decode steps read the contexts from memory as much as the weights (32
    int4 streams at context 256 read more cache than weight bytes a step), and a 16-bit cache
    halves that read. float16
    rather than bfloat16: on the default model with int4 weights its perplexity is float32's
    (-0.28% against -0.21% from float32's model; bfloat16 +0.70%) at the same speed (README,
    "Quantization"); a model whose K/V exceed float16's range (65504) needs kv_cache_dtype
    bfloat16 or float32. Float32 weights keep a float32 cache: their results match
    transformers'. A dtype other than the activations' needs the torch backend (its operators
    convert between the two; the Triton kernels read the cache in the query's dtype):
    ValueError otherwise."""
    if name == "auto":
        mixed = (
            device.type == "cpu"
            and attention_backend == "torch"
            and dtype == torch.float32
            and quantized
        )
        return torch.float16 if mixed else dtype
    kv_dtype = KV_CACHE_DTYPES[name]
    if kv_dtype != dtype and attention_backend != "torch":
        raise ValueError(
            f"kv_cache_dtype {name} with {str(dtype).removeprefix('torch.')} activations needs "
            f"the torch attention backend, not {attention_backend!r}: set kv_cache_dtype to auto "
            "or to the model's dtype"
        )
    return kv_dtype


def leave_triton_unloaded(device_name: str, attention_backend: str) -> bool:
    """Keeps the Triton package out of a process that serves on a CPU with the torch backend,
    where nothing runs a Triton kernel: torch's compiler imports the package whenever it is
    installed (``torch._dynamo.utils`` registers ``triton.language.dtype`` as a constant type),
    and loading it maps libtriton, ~67 MiB resident and ~0.15 s of start-up for nothing. The
    package is marked absent (``sys.modules["triton"] = None``: importing it raises ImportError,
    which torch reads as "not installed"). Call it before torch's compiler is imported; it does
    nothing where a GPU or the Triton backend may need the package, or once it is loaded.
    Returns whether it marked it."""
    if "triton" in sys.modules:
        return False
    try:
        device = resolve_device(device_name)
        backend = resolve_attention_backend(attention_backend, device)
    except (RuntimeError, ValueError):  # the engine reports these at start-up
        return False
    if device.type != "cpu" or backend != "torch":
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]
    return True


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``auto`` -> triton on CUDA, torch on CPU. Triton on a CPU runs only in interpreter mode."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend 'triton' on a CPU needs TRITON_INTERPRET=1 (the interpreter, for "
            "tests); use 'torch' or 'auto' to serve on a CPU"
        )
    return name


def freeze_long_lived_objects() -> None:
    """Moves every object alive now out of the garbage collector's scans (``gc.freeze``), after a
    full collection. Loading a model and compiling its step graphs leave ~230,000 tracked objects
    that live as long as the process; each full collection walked them all, between decode steps
    (32 int4 streams held to AVX2: ~5% of a step's samples in the collector, and steps 0.90-0.95x
    as long once they are frozen). For a process that owns its engine (the server, the CLI's
    commands, the benchmarks) once loading and compiling are done: an object frozen here that
    later becomes cyclic garbage is never freed, so a library that builds and drops engines must
    not call it."""
    gc.collect()
    gc.freeze()


def release_free_memory() -> None:
    """Hands the C heap's free memory back to the system (glibc's ``malloc_trim``). Tensors of a
    few MiB come from the heap once larger ones have been freed (glibc raises its mmap threshold),
    and freeing them keeps the pages: without this a model quantized at load keeps the resident
    size of its float weights."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.malloc_trim(0)
