"""The executor: what the engine calls to run a scheduled batch, whatever the world size.

    executor = start_executor(world_size, runner_kwargs, num_threads)
    sampled = executor.execute(batch)      # one ragged forward on every rank + sampling

``LocalExecutor`` runs the model in this process. ``TensorParallelExecutor``
(``engine/tensor_parallel/``) starts or joins the other ranks and sends them each step first. A
failure that leaves the executor unable to run another step (a rank gone, ranks out of step)
raises ``ExecutorFailedError``; any other exception fails the batch alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.sampler import SamplerOutput
    from scheduler.batch import ScheduledBatch

__all__ = ["Executor", "ExecutorFailedError", "LocalExecutor", "start_executor"]


class ExecutorFailedError(RuntimeError):
    """The executor cannot run another step (every later ``execute`` raises it too)."""


class Executor(Protocol):
    runner: ModelRunner  # this process's runner (rank 0's under tensor parallelism)

    def execute(self, batch: ScheduledBatch) -> SamplerOutput: ...

    def drop_requests(self, request_ids: list[str]) -> None: ...

    def add_failure_listener(self, listener: Callable[[str], None]) -> None: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One process: the runner itself. It never fails for good."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        return self.runner.execute(batch)

    def drop_requests(self, request_ids: list[str]) -> None:
        self.runner.drop_requests(request_ids)

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """Nothing outside this process can fail: the listener is never called."""

    def shutdown(self) -> None:
        """Nothing to stop."""


def start_executor(
    world_size: int, runner_kwargs: dict[str, Any], num_threads: int | None
) -> Executor:
    """Loads the model (its shard on every rank for ``world_size`` > 1) and returns the executor
    that runs it. ``runner_kwargs`` are ``ModelRunner``'s arguments."""
    from engine.model_runner import ModelRunner
    from engine.tensor_parallel.group import start_tensor_parallel

    if world_size == 1:
        return LocalExecutor(ModelRunner(**runner_kwargs))

    return start_tensor_parallel(world_size, runner_kwargs, num_threads)
