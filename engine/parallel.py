"""This process's place among tensor-parallel ranks, and the collectives the layers call.

Megatron-style sharding: column-parallel layers split their output features across ranks and need
no communication; row-parallel layers split their input features and all-reduce their partial sums;
the vocabulary is split for the embedding (all-reduce) and the LM head (all-gather). At
``world_size == 1`` every collective is the identity, so a single process runs the same model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    # a torch.distributed process group; None means the default group
    group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of {self.world_size}")

    def shard(self, size: int, what: str) -> int:
        """This rank's share of ``size`` features, which must split evenly."""
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) does not split evenly over "
                f"{self.world_size} tensor-parallel ranks"
            )
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over ranks (in place)."""
        if self.world_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (all ranks call it together)."""
        if self.world_size == 1:
            return value
        # NCCL reduces GPU tensors only, gloo CPU tensors
        device = "cuda" if torch.distributed.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Ranks' ``x`` concatenated along the last dimension, rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_PROCESS = ParallelContext()
