"""Which attention heads each tensor-parallel rank holds, and whether a model can be split at all.

Query heads stay with their KV head (a rank runs whole GQA groups), so a rank's local heads keep
the mapping ``kv_head = q_head // (num_heads / num_kv_heads)`` that the attention op assumes.

    num_kv_heads >= world_size: the KV heads are dealt out in contiguous runs, as evenly as they go;
        9 query / 3 KV heads, 2 ranks:  rank 0 kv [0]     q [0:3]
                                        rank 1 kv [1, 2]  q [3:9]
    num_kv_heads <  world_size: each KV head is replicated on world_size / num_kv_heads ranks, which
        split its query heads; 4 query / 1 KV head, 2 ranks:  rank 0 kv [0] q [0:2]
                                                              rank 1 kv [0] q [2:4]

Anything else (3 KV heads on 2 ranks of 4 query heads each, ...) is refused by
``check_tensor_parallel`` before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig


class TensorParallelConfigError(ValueError):
    """The model cannot be split over the requested number of tensor-parallel ranks."""


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: query heads ``[head_start, head_start + num_heads)`` and KV
    heads ``[kv_head_start, kv_head_start + num_kv_heads)``."""

    head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    """This rank's heads (see the module docstring). Raises TensorParallelConfigError when the
    heads cannot be split over ``world_size`` ranks."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise TensorParallelConfigError(
            f"{num_heads} query heads do not form groups over {num_kv_heads} KV heads"
        )
    group_size = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv_start = rank * num_kv_heads // world_size
        kv_end = (rank + 1) * num_kv_heads // world_size
        return HeadShard(
            head_start=kv_start * group_size,
            num_heads=(kv_end - kv_start) * group_size,
            kv_head_start=kv_start,
            num_kv_heads=kv_end - kv_start,
        )
    if world_size % num_kv_heads or num_heads % world_size:
        raise TensorParallelConfigError(
            f"{num_heads} query / {num_kv_heads} KV heads cannot be split over {world_size} "
            f"tensor-parallel ranks: with fewer KV heads than ranks, the rank count must be a "
            f"multiple of the KV heads ({num_kv_heads}) and divide the query heads ({num_heads})"
        )
    replicas = world_size // num_kv_heads
    heads_per_rank = num_heads // world_size
    return HeadShard(
        head_start=rank * heads_per_rank,
        num_heads=heads_per_rank,
        kv_head_start=rank // replicas,
        num_kv_heads=1,
    )


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raises TensorParallelConfigError, naming the size at fault, when ``config`` cannot run on
    ``world_size`` ranks. Called at start-up, before weights are loaded."""
    if world_size < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size == 1:
        return
    for rank in range(world_size):
        shard_heads(config.num_heads, config.num_kv_heads, rank, world_size)
    sizes = {"the MLP's intermediate_size": config.intermediate_size}
    if config.num_experts:  # experts are split by their intermediate dimension (engine/moe.py)
        sizes["the experts' moe_intermediate_size"] = config.moe_intermediate_size
        sizes["the shared expert's shared_expert_intermediate_size"] = (
            config.shared_expert_intermediate_size
        )
        if not config.dense_mlp_layers:  # no dense MLP is built: its size need not split
            del sizes["the MLP's intermediate_size"]
    for what, size in sizes.items():
        if size % world_size:
            raise TensorParallelConfigError(
                f"{what} ({size}) does not split evenly over {world_size} tensor-parallel ranks"
            )
