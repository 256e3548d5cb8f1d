"""Sizing and allocating the KV-cache tensor from a memory budget.

The cache is one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (K at
index 0, V at 1). A block of SmolLM2-135M in bfloat16: 30 layers x 2 x 16 x 3 x 64 x 2 bytes =
368,640 bytes, so 1 GiB holds 2,912 blocks (46,592 tokens).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size


def free_memory_bytes(device: torch.device) -> int:
    """Memory available for new allocations: the GPU's free memory, or MemAvailable on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; give kv_cache_memory in bytes")


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
    """A zeroed cache. On a CPU it lives in an anonymous memory map: pages are zero and are
    committed only when first written, so a large budget costs nothing until it is used."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) * num_blocks
    buffer = mmap.mmap(-1, num_bytes)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
