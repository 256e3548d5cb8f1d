"""Sizing and allocating the KV-cache tensor from a memory budget.

The cache is one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (K at
index 0, V at 1). A block of SmolLM2-135M in bfloat16: 30 layers x 2 x 16 x 3 x 64 x 2 bytes =
368,640 bytes, so 1 GiB holds 2,912 blocks (46,592 tokens).

The cache's memory is committed when it is allocated, at start-up: resident memory holds the whole
budget from then on, instead of growing towards it for hours as requests reach block after block,
and a budget that does not fit stops the start instead of a pod meeting its memory limit later.

On a CPU the cache asks for transparent huge pages (2 MiB) before it is committed. A decode step
reads every running request's context in every layer, blocks that lie anywhere in the cache (32
streams at context 256: ~6 MB a layer, ~190 MB a step for the default model), and 2 MiB pages
need 512 times fewer address translations for them. See ``_ask_for_huge_pages`` for the figures.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 * 2**20


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size


def free_memory_bytes(device: torch.device) -> int:
    """Memory available for new allocations: the GPU's free memory; on a CPU, MemAvailable, or
    less where the process's memory cgroup (a container's or pod's limit) leaves less."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
            break
    else:
        raise RuntimeError(
            "cannot read MemAvailable from /proc/meminfo; give kv_cache_memory in bytes"
        )
    cgroup = cgroup_available_bytes()
    return available if cgroup is None else min(available, cgroup)


def cgroup_available_bytes(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """What the memory cgroups holding this process still allow it: the smallest ``limit -
    (usage - inactive file cache)`` over the process's cgroup and its ancestors that have a limit
    (kubelet counts a pod's working set the same way: inactive page cache is reclaimed before the
    limit is enforced). cgroup v2 and v1; None when no limit applies or none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2: one unified hierarchy
            found += _cgroup_levels(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own tree
            found += _cgroup_levels(
                root / "memory",
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
    return min(found) if found else None


# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number
_NO_LIMIT = 2**62


def _cgroup_levels(
    mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str
) -> list[int]:
    """Available bytes at each level from the process's cgroup up to the mount's root that has a
    limit. Inside a container the mount's root is often the process's own cgroup while
    /proc/self/cgroup still names the host's path: levels that do not exist are skipped."""
    parts = [part for part in path.strip("/").split("/") if part]
    found = []
    for depth in range(len(parts), -1, -1):
        folder = mount.joinpath(*parts[:depth])
        try:
            raw_limit = (folder / limit_file).read_text().strip()
            if raw_limit == "max" or int(raw_limit) >= _NO_LIMIT:
                continue
            usage = int((folder / usage_file).read_text())
            inactive = 0
            for stat in (folder / "memory.stat").read_text().splitlines():
                key, _, value = stat.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
                    break
        except (OSError, ValueError):
            continue
        found.append(max(0, int(raw_limit) - max(0, usage - inactive)))
    return found


def num_blocks_for_budget(
    budget: int | float, block_bytes: int, device: torch.device, max_useful_blocks: int
) -> int:
    """Blocks that fit ``budget`` (bytes, or a fraction of free memory when a float below 1),
    capped at ``max_useful_blocks`` (what the batch limits could ever fill). At least 1."""
    if isinstance(budget, float) and budget < 1:
        num_bytes = int(free_memory_bytes(device) * budget)
    else:
        num_bytes = int(budget)
    num_blocks = min(num_bytes // block_bytes, max_useful_blocks)
    if num_blocks < 1:
        raise ValueError(
            f"the KV-cache budget ({num_bytes} bytes) holds no block of {block_bytes} bytes; "
            "raise kv_cache_memory"
        )
    return num_blocks


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A zeroed cache whose memory is committed now. A CPU maps a fresh allocation's pages only
    when they are first written: zeroing writes every one of them, so resident memory rises by the
    cache's size here (a GPU's allocation is committed anyway). A cache larger than the free
    memory raises ValueError first: committing it would end in the out-of-memory killer."""
    num_bytes = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) * num_blocks
    try:
        free_bytes = free_memory_bytes(device)
    except RuntimeError:  # no /proc/meminfo: the size is taken as given
        free_bytes = num_bytes
    if num_bytes > free_bytes:
        raise ValueError(
            f"the KV-cache budget of {_mib(num_bytes)} ({num_blocks} blocks) does not fit: "
            f"{_mib(free_bytes)} of memory is free on {device.type}; lower kv_cache_memory "
            "(bytes such as '2GiB', or a fraction of free memory such as 0.3), or num_kv_blocks "
            "where it is set"
        )
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu":
        _ask_for_huge_pages(cache)
    cache.zero_()
    return cache


def _ask_for_huge_pages(cache: torch.Tensor) -> None:
    """``madvise(MADV_HUGEPAGE)`` over the 2 MiB pages that lie wholly inside the cache's memory,
    not yet written (a fresh allocation of this size is mapped on first write): the kernel then
    backs them with huge pages where its transparent huge pages are "always" or "madvise" (the
    common default) and it has them to give; where it has not, or they are "never", or this is
    not Linux, the pages stay 4 KiB and nothing else changes. Measured on an AMD EPYC (2 cores),
    the default model with int4 weights, 32 streams at context 256 alternating in one process
    with an engine whose cache has 4 KiB pages: steps 0.953x and 0.948x the time (medians of 10
    rounds, two runs). The commit costs what the kernel needs to find the pages: 6.7 GiB in 1.4 s
    where it had them free, up to ~9 s where it first had to gather them, against 1.5-1.7 s in
    4 KiB pages."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is None:
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    begin = -(-cache.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (cache.data_ptr() + cache.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > begin:  # not checked: a kernel without huge pages refuses, and 4 KiB pages stay
        madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), advice)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


# float8 e4m3fn's largest magnitude (448) in its bytes' low seven bits; a larger K/V is stored
# as it (torch's conversion saturates)
FLOAT8_TOP = 0x7E
# how many of the first stored tokens Float8RangeWatch looks at
FLOAT8_WATCH_TOKENS = 4096


class Float8RangeWatch:
    """A float8 e4m3fn KV cache holds K/V up to +-448 and stores anything larger as +-448,
    without notice. This looks at the bytes of the first ``FLOAT8_WATCH_TOKENS`` tokens a cache
    stores (a gather of their rows after their step: a few MiB at most, a few steps in all) and
    logs one warning naming the layers whose K or V reached +-448, which a model needs a 16-bit
    cache for. A cache of another dtype is never looked at."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.left = FLOAT8_WATCH_TOKENS if kv_cache.dtype == torch.float8_e4m3fn else 0
        self.layers: list[int] = []  # where the largest value showed (set when it warns)

    def check(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After a step that stored its tokens at ``slot_mapping`` (-1: not stored)."""
        if self.left <= 0:
            return
        slots = slot_mapping[slot_mapping >= 0][: self.left]
        self.left -= slots.numel()
        num_layers = kv_cache.shape[0]
        rows = kv_cache.view(torch.uint8).view(num_layers, 2, -1, kv_cache[0, 0, 0, 0].numel())
        top = (rows.index_select(2, slots) & 0x7F) == FLOAT8_TOP
        layers = top.flatten(1).any(1).nonzero().flatten().tolist()
        if layers:
            self.left = 0
            self.layers = layers
            logger.warning(
                "the float8 KV cache stored K/V of layer(s) %s at +-448, its largest value "
                "(larger ones are stored as +-448 too): this model's results suffer; serve it "
                "with a 16-bit cache (kv_cache_dtype auto, bfloat16 or float16)",
                ", ".join(map(str, layers)),
            )
