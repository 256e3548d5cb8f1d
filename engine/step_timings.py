"""Wall-clock time per phase of each engine step, recorded only while someone profiles.

The runner times each forward pass and each sampling, the engine each step's scheduling
(``schedule()`` plus ``update()``). On a GPU the device is synchronized before and after each
phase, so the queued work is counted in the phase that queued it; that costs speed, which is why
nothing is timed unless a ``StepTimings`` is attached (``init_inference``'s
``profile_model_time()``, ``splitfuse bench --offline --profile``). Each timed phase is also a
``torch.profiler`` range, ``splitfuse.<phase>``, seen in a trace when a profiler records.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

Phase = Literal["forward", "sampling", "scheduling"]


@dataclass
class StepTimings:
    """Seconds per occurrence of each phase, in the order they ran."""

    device: torch.device
    forward: list[float] = field(default_factory=list)  # one per forward pass
    sampling: list[float] = field(default_factory=list)  # one per step that sampled
    # one per schedule() and one per update(): two per step that ran a batch
    scheduling: list[float] = field(default_factory=list)

    @contextmanager
    def measure(self, phase: Phase) -> Iterator[None]:
        """Adds the time the ``with`` body takes (its device work included) to ``phase``."""
        with torch.profiler.record_function(f"splitfuse.{phase}"):
            self._synchronize()
            start = time.perf_counter()
            try:
                yield
            finally:
                self._synchronize()
                getattr(self, phase).append(time.perf_counter() - start)

    def clear(self) -> None:
        self.forward.clear()
        self.sampling.clear()
        self.scheduling.clear()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
