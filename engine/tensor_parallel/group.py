"""Rank 0 of a tensor-parallel engine: it starts (or, under torchrun, joins) the other ranks,
sends each step's inputs before running its own share of the forward pass, and watches the
workers it started.

    rank 0 (engine thread)                      ranks 1..N-1 (engine/tensor_parallel/worker.py)
    schedule -> build inputs -> send_step  ---> receive_step
             -> forward (all-reduce per layer <-> forward)
             -> sample -> update

Faults: a watchdog thread waits on the workers' process sentinels, so a worker's death is seen at
once, even while the engine is idle. It records the failure, kills the other workers and calls the
failure listeners (the server then fails every pending request and exits non-zero); every later
step raises. A step whose collectives fail (a peer gone mid-step) raises too.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.executor import ExecutorFailedError
from engine.input_builder import ModelInput, build_model_input
from engine.model_runner import ModelRunner
from engine.sampler import SamplerOutput
from engine.tensor_parallel.distributed import (
    MODEL_TIMEOUT,
    DistributedSetup,
    join_process_group,
    joining_key,
    leave_process_group,
    open_loopback_store,
    threads_per_rank,
    torchrun_environment,
)
from engine.tensor_parallel.protocol import send_step, send_stop
from engine.tensor_parallel.worker import spawned_worker_main
from scheduler.batch import ScheduledBatch

logger = logging.getLogger(__name__)

STARTUP_POLL_SECONDS = 0.05
STOP_TIMEOUT_SECONDS = 10.0
# how long a failed step waits for a worker's exit to explain the failure
DEATH_GRACE_SECONDS = 0.5


class TensorParallelError(ExecutorFailedError):
    """A tensor-parallel rank failed; the engine cannot run another step."""


class TensorParallelGroup:
    """Rank 0's handle on the group: the step lock, the failure state and the workers."""

    def __init__(self, setup: DistributedSetup, processes: list[BaseProcess]) -> None:
        self.setup = setup
        self.processes = processes  # rank i + 1 at index i; empty under torchrun
        self.failure: str | None = None
        self._step_lock = threading.Lock()  # steps and the final stop message, one at a time
        self._state_lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        self._closing = False
        self._closed = False
        self._wake_reader, self._wake_writer = mp.get_context("spawn").Pipe(duplex=False)
        self._watchdog = threading.Thread(
            target=self._watch, name="splitfuse-tp-watchdog", daemon=True
        )
        self._watchdog.start()
        atexit.register(self.shutdown)

    @property
    def control_group(self) -> Any:
        return self.setup.control_group

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self.processes if process.pid is not None]

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """Calls ``listener(message)`` once if a rank fails (at once if one already has)."""
        with self._state_lock:
            failure = self.failure
            if failure is None:
                self._listeners.append(listener)
        if failure is not None:
            listener(failure)

    def check_alive(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self._closing:
            raise TensorParallelError("the tensor-parallel group is shut down")

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Holds the group for one step; a step that raises leaves the ranks out of step, so the
        group is marked failed."""
        with self._step_lock:
            self.check_alive()
            try:
                yield
            except BaseException as error:
                # a peer's death usually shows first as a connection error: name the peer
                dead = self._dead_worker_message(DEATH_GRACE_SECONDS)
                self.fail(dead or f"a tensor-parallel step failed: {type(error).__name__}: {error}")
                if not isinstance(error, Exception):
                    raise  # KeyboardInterrupt, SystemExit
                raise TensorParallelError(self.failure or str(error)) from error

    def fail(self, message: str) -> None:
        """Records the first failure, tells the listeners and kills the workers."""
        with self._state_lock:
            if self.failure is not None or self._closing:
                return
            self.failure = message
            listeners, self._listeners = self._listeners, []
        logger.error("%s; stopping the tensor-parallel workers", message)
        for listener in listeners:
            try:
                listener(message)
            except Exception:  # noqa: BLE001 - one listener must not stop the others
                logger.exception("a tensor-parallel failure listener raised")
        self._kill_workers()

    def shutdown(self) -> None:
        """Stops the workers (a stop message, then a kill after a grace period) and leaves the
        process group. Idempotent; also run at interpreter exit."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = self._closing = True
        atexit.unregister(self.shutdown)
        stopped = False
        if self.failure is None and self._step_lock.acquire(timeout=STOP_TIMEOUT_SECONDS):
            try:
                send_stop(self.control_group)
                stopped = True
            except Exception as error:  # noqa: BLE001 - a dead peer: fall back to killing
                logger.warning("could not send the stop message to the workers: %s", error)
            finally:
                self._step_lock.release()
        deadline = time.monotonic() + (STOP_TIMEOUT_SECONDS if stopped else 0.0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self._kill_workers()
        self._wake_writer.send(None)
        self._watchdog.join(STOP_TIMEOUT_SECONDS)
        # after a failure NCCL's teardown may wait on the dead peers; gloo's never does
        if stopped or dist.get_backend() == "gloo":
            leave_process_group()

    def _kill_workers(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(STOP_TIMEOUT_SECONDS)

    def _watch(self) -> None:
        message = self._dead_worker_message(None, self._wake_reader)
        if message is not None:
            self.fail(message)

    def _dead_worker_message(self, timeout: float | None, *also: Any) -> str | None:
        """Waits up to ``timeout`` seconds (None: for ever) for a worker to exit, or for one of
        ``also`` to be ready; describes the first worker found dead."""
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, 1)}
        ready = wait([*sentinels, *also], timeout)
        dead = [sentinels[handle] for handle in ready if handle in sentinels]
        if not dead:
            return None
        rank = min(dead)
        process = self.processes[rank - 1]
        # another thread may be reaping it at this moment: its exit code appears shortly
        deadline = time.monotonic() + 1.0
        while process.exitcode is None and time.monotonic() < deadline:
            process.join(0.05)
        return (
            f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
            f"{process.exitcode}"
        )


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: sends each step's inputs to the other ranks, then runs its share."""

    def __init__(self, group: TensorParallelGroup, **runner_kwargs: Any) -> None:
        self.group = group
        super().__init__(**runner_kwargs, parallel=group.setup.parallel)

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        return self.run(build_model_input(batch, self.block_size, self.device, self.prompt_tiles))

    def run(self, inputs: ModelInput) -> torch.Tensor:
        """Every rank runs ``inputs``; returns the logits of ``inputs.sample_rows``, float32
        ``[num_sampled, vocab_size]``."""
        with self.group.step():
            send_step(inputs, self.group.control_group)
            return super().run(inputs)


class TensorParallelExecutor:
    """The engine's executor for world size > 1 (``engine/executor.py``): rank 0's runner and
    its handle on the other ranks."""

    def __init__(self, group: TensorParallelGroup, runner: TensorParallelRunner) -> None:
        self.group = group
        self.runner = runner

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        self.group.check_alive()
        return self.runner.execute(batch)

    def drop_requests(self, request_ids: list[str]) -> None:
        self.runner.drop_requests(request_ids)

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        self.group.add_failure_listener(listener)

    def shutdown(self) -> None:
        self.group.shutdown()


def start_tensor_parallel(
    world_size: int, runner_kwargs: dict[str, Any], num_threads: int | None
) -> TensorParallelExecutor:
    """Starts ranks 1..world_size-1 on this machine (or joins torchrun's group as rank 0), sends
    them ``runner_kwargs`` (``ModelRunner`` arguments) and builds rank 0's runner. Every rank
    loads only its shard: from the model folder, or from a model in this process's memory
    (``state_dict``), whose tensors the ranks started here read in shared memory (moved there
    once by ``torch.multiprocessing``, never copied per rank)."""
    device: torch.device = runner_kwargs["device"]
    state_dict = runner_kwargs.get("state_dict")
    if dist.is_initialized():
        raise RuntimeError("this process already runs a tensor-parallel engine; shut it down first")
    env = torchrun_environment()
    processes: list[BaseProcess] = []
    if env is not None and state_dict is not None:
        raise ValueError(
            "a model in memory is sharded over ranks this process starts itself: run it in one "
            "process, not under torchrun"
        )
    if env is not None:
        if env.world_size != world_size or env.rank != 0:
            raise ValueError(
                f"under torchrun this engine is rank 0 of tensor_parallel_size {world_size}, "
                f"but the environment says rank {env.rank} of WORLD_SIZE {env.world_size}"
            )
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(threads_per_rank(num_threads, ranks_here))
        setup = join_process_group(0, world_size, device.type, local_rank=env.local_rank)
    else:
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} needs {world_size} GPUs; this machine has "
                f"{torch.cuda.device_count()}"
            )
        ranks_here = world_size
        threads = threads_per_rank(num_threads, world_size)
        torch.set_num_threads(threads)
        setup, processes = _spawn_workers(world_size, device.type, threads, state_dict)
    group = TensorParallelGroup(setup, processes)
    try:
        kwargs = dict(runner_kwargs, device=setup.device)
        budget = kwargs["kv_cache_memory"]
        if device.type == "cpu":
            # the ranks on a machine share its memory: each takes its part of the budget (a
            # fraction of free memory, or bytes); a GPU rank has its device to itself
            is_fraction = isinstance(budget, float) and budget < 1
            kwargs["kv_cache_memory"] = (
                budget / ranks_here if is_fraction else max(1, int(budget) // ranks_here)
            )
        # (the tensors went to the workers as they started)
        shared = {
            name: value for name, value in kwargs.items() if name not in ("device", "state_dict")
        }
        dist.broadcast_object_list([shared], src=0, group=setup.control_group)
        runner = TensorParallelRunner(group, **kwargs)
    except BaseException as error:
        # the workers may be waiting in a collective rank 0 never reaches: stop them at once
        group.fail(f"rank 0 failed to start: {type(error).__name__}: {error}")
        group.shutdown()
        raise
    logger.info(
        "tensor parallel: %d ranks (%s), worker pids %s",
        world_size,
        dist.get_backend(),
        group.worker_pids,
    )
    return TensorParallelExecutor(group, runner)


def _spawn_workers(
    world_size: int,
    device_type: str,
    num_threads: int,
    state_dict: Mapping[str, torch.Tensor] | None,
) -> tuple[DistributedSetup, list[BaseProcess]]:
    store = open_loopback_store(world_size)
    context = mp.get_context("spawn")
    processes: list[BaseProcess] = []
    try:
        for rank in range(1, world_size):
            process = context.Process(
                target=spawned_worker_main,
                args=(
                    rank,
                    world_size,
                    store.port,
                    device_type,
                    num_threads,
                    os.getpid(),
                    logging.getLogger().getEffectiveLevel(),
                    state_dict,
                ),
                name=f"splitfuse-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            processes.append(process)
        _wait_until_joining(store, processes)
        setup = join_process_group(0, world_size, device_type, store=store)
    except BaseException:
        for process in processes:
            process.kill()
            process.join()
        raise
    return setup, processes


def _wait_until_joining(store: dist.TCPStore, processes: list[BaseProcess]) -> None:
    """Waits until every worker is about to join the group, failing at once if one dies first
    (a worker that fails to start would otherwise leave rank 0 waiting for the whole timeout)."""
    keys = [joining_key(rank) for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + MODEL_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, process in enumerate(processes, 1):
            if not process.is_alive():
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} exited with code {process.exitcode} "
                    "while starting (see its log above)"
                )
        if time.monotonic() > deadline:
            raise RuntimeError("tensor-parallel workers did not start in time")
        time.sleep(STARTUP_POLL_SECONDS)
