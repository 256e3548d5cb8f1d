"""A tensor-parallel rank other than 0: it loads its shard of the model and its part of the KV
cache, then runs every forward pass rank 0 sends, until rank 0 says stop.

Started by rank 0 (``torch.multiprocessing`` spawn, one machine) or by ``torchrun`` (through
``splitfuse serve``). It never sees a request: rank 0 schedules, samples and answers. It exits
non-zero when anything fails, and at once when the process that started it is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.device import resolve_device
from engine.model_runner import ModelRunner
from engine.tensor_parallel.distributed import (
    DistributedSetup,
    connect_loopback_store,
    join_process_group,
    joining_key,
    leave_process_group,
    threads_per_rank,
    torchrun_environment,
)
from engine.tensor_parallel.protocol import receive_step

logger = logging.getLogger(__name__)

PARENT_POLL_SECONDS = 0.5


def spawned_worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    device_type: str,
    num_threads: int,
    parent_pid: int,
    log_level: int,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Entry point of a worker spawned by rank 0 on the same machine. ``state_dict``: the
    weights of a model in rank 0's memory (in shared memory), instead of the model folder."""
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _leave_signals_to_rank0()
    _exit_when_orphaned(parent_pid)
    torch.set_num_threads(num_threads)
    store = connect_loopback_store(store_port, world_size)
    store.set(joining_key(rank), "1")
    setup = join_process_group(rank, world_size, device_type, store=store)
    run_worker(setup, state_dict)


def run_torchrun_worker(config: EngineConfig) -> int:
    """``splitfuse serve`` on a torchrun rank other than 0: joins the group and serves rank 0's
    steps. Returns the exit status (2 when the launch does not match ``config``)."""
    env = torchrun_environment()
    if env is None or env.rank == 0:
        raise RuntimeError("run_torchrun_worker is for torchrun ranks other than 0")
    if env.world_size != config.tensor_parallel_size:
        logger.error(
            "torchrun started %d ranks, but tensor_parallel_size is %d: launch "
            "nnodes x nproc-per-node = tensor_parallel_size processes",
            env.world_size,
            config.tensor_parallel_size,
        )
        return 2
    _leave_signals_to_rank0()
    _exit_when_orphaned(os.getppid())
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    torch.set_num_threads(threads_per_rank(config.num_threads, ranks_here))
    device_type = resolve_device(config.device).type
    setup = join_process_group(env.rank, env.world_size, device_type, local_rank=env.local_rank)
    run_worker(setup)
    return 0


def run_worker(setup: DistributedSetup, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Builds this rank's runner from rank 0's settings (and ``state_dict``'s tensors, for a
    model in memory), then serves steps until told to stop."""
    settings: list[Any] = [None]
    dist.broadcast_object_list(settings, src=0, group=setup.control_group)
    runner_kwargs = dict(settings[0], device=setup.device, parallel=setup.parallel)
    runner = ModelRunner(**runner_kwargs, state_dict=state_dict)
    if state_dict is not None:
        # this process's copy of the mapping: emptied, it unmaps the shared tensors here
        state_dict.clear()
    logger.info(
        "rank %d of %d ready: %d KV blocks",
        setup.parallel.rank,
        setup.parallel.world_size,
        runner.num_kv_blocks,
    )
    num_steps = 0
    while (inputs := receive_step(setup.control_group, setup.device)) is not None:
        runner.run(inputs)
        num_steps += 1
    logger.info("rank %d stopping after %d steps", setup.parallel.rank, num_steps)
    leave_process_group()


def _leave_signals_to_rank0() -> None:
    """Ctrl-C, or SIGTERM sent to every process (by a terminal, ``timeout``, torchrun's agent), is
    rank 0's to act on: it drains its requests, then stops this rank with a message. A rank that
    is never stopped still ends: with its parent, or when rank 0's connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Ends this process when its parent is gone (re-parented): no worker outlives the engine."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="splitfuse-parent-watch", daemon=True).start()
