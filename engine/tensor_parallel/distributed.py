"""Joining the tensor-parallel process group: on one machine through a loopback store that rank 0
opens, on several under ``torchrun`` (rendezvous from its environment).

Two groups are made, in the same order on every rank:

- the default group (NCCL on CUDA, gloo on CPU) carries the model's all-reduces and all-gathers,
  with a bounded timeout, so a rank that hangs mid-step fails the step instead of hanging it;
- a gloo control group carries rank 0's per-step inputs (``engine/tensor_parallel/protocol.py``).
  Ranks other than 0 wait on it while the engine is idle, so its timeout is long.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel import ParallelContext

LOOPBACK = "127.0.0.1"
# a step's collectives: every rank is in the same forward pass, so waits are short
MODEL_TIMEOUT = timedelta(minutes=10)
# ranks other than 0 wait here for the next step however long the engine is idle
CONTROL_TIMEOUT = timedelta(days=365)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedSetup:
    """What a rank needs after joining: its place for the model, the control group, its device."""

    parallel: ParallelContext
    control_group: Any
    device: torch.device
    local_rank: int


@dataclass(frozen=True)
class TorchrunEnvironment:
    rank: int
    world_size: int
    local_rank: int


def torchrun_environment() -> TorchrunEnvironment | None:
    """This process's place when started by ``torchrun`` (all of its variables set), else None."""
    if not all(name in os.environ for name in TORCHRUN_VARIABLES):
        return None
    return TorchrunEnvironment(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
    )


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def threads_per_rank(num_threads: int | None, ranks_on_this_machine: int) -> int:
    """``num_threads`` when given, else this machine's cores shared out so ranks do not contend."""
    if num_threads is not None:
        return num_threads
    return max(1, len(os.sched_getaffinity(0)) // ranks_on_this_machine)


def open_loopback_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (the OS picks it: no race)."""
    return dist.TCPStore(
        LOOPBACK, 0, world_size, is_master=True, timeout=MODEL_TIMEOUT, wait_for_workers=False
    )


def connect_loopback_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=MODEL_TIMEOUT)


def joining_key(rank: int) -> str:
    """The store key a spawned worker sets just before it joins the group."""
    return f"splitfuse/worker-{rank}-joining"


def join_process_group(
    rank: int,
    world_size: int,
    device_type: str,
    *,
    store: dist.Store | None = None,
    local_rank: int | None = None,
) -> DistributedSetup:
    """Joins the default group (through ``store``, or torchrun's ``env://`` when None) and makes
    the control group. Blocks until every rank has joined."""
    local_rank = rank if local_rank is None else local_rank
    device = torch.device("cpu")
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"tensor-parallel rank {rank} needs GPU {local_rank}, but this machine has "
                f"{torch.cuda.device_count()}"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if store is None:
        dist.init_process_group(
            backend_for(device_type), init_method="env://", timeout=MODEL_TIMEOUT
        )
    else:
        dist.init_process_group(
            backend_for(device_type),
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=MODEL_TIMEOUT,
        )
    control_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return DistributedSetup(
        parallel=ParallelContext(rank=rank, world_size=world_size),
        control_group=control_group,
        device=device,
        local_rank=local_rank,
    )


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
