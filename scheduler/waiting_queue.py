"""The waiting queue in admission order, under the scheduler's two policies.

``fcfs``: arrival order; a preempted request goes back to the front.

``priority``: lower ``priority`` first, then arrival order; a preempted request keeps its arrival
position, ahead of every later arrival of its priority. Aging bounds the wait: once
``max_overtakes`` admissions have happened since a request arrived, it is *promoted*, and promoted
requests come first, in arrival order, whatever their priority. So at most ``max_overtakes``
requests that arrived after a request are admitted before it. Promotions take effect at
``promote()``, which the scheduler calls at the start of each step: the order holds still within
a step, and an admission that would overtake a request that became due during the step is not
made (``overtakes_too_far``): admissions stop there, and the request goes first at the next step.

Worked example, ``max_overtakes`` 2: ``a`` (priority 5) arrives, then ``b``, ``c``, ``d`` (priority
0). The order is ``b c d a``. ``b`` is admitted (one admission since ``a`` arrived), then ``c``
(two): ``a`` is promoted and the order is ``a d``.

Pure Python, no locking; the scheduler is its only user.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from scheduler.request import Request


@dataclass
class _Entry:
    request: Request
    key: tuple[int, int]  # the order among requests that are not promoted
    seq: int  # the request's arrival order
    mark: int  # admissions before the request arrived


class WaitingQueue:
    """Waiting requests by id; iteration yields them in admission order (see the module)."""

    def __init__(self, by_priority: bool, max_overtakes: int) -> None:
        if not isinstance(max_overtakes, int) or max_overtakes < 1:
            raise ValueError(f"max_overtakes must be an integer >= 1, got {max_overtakes!r}")
        self.by_priority = by_priority
        self.max_overtakes = max_overtakes
        self.num_admitted = 0  # admissions so far; the scheduler counts them
        self._promoted_mark = -max_overtakes  # requests with marks up to this are promoted
        self._entries: dict[str, _Entry] = {}
        self._by_key: list[tuple[tuple[int, int], str]] = []
        self._by_seq: list[tuple[int, str]] = []  # kept under ``priority`` only
        self._num_front = 0

    def promote(self) -> None:
        """Promote the requests that have waited through ``max_overtakes`` admissions."""
        self._promoted_mark = self.num_admitted - self.max_overtakes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def push(self, request: Request, seq: int, mark: int, front: bool = False) -> None:
        """Queue ``request`` (arrival order ``seq``, ``mark`` admissions before it arrived);
        ``front``: a preempted request (fcfs: before every other; priority: by arrival)."""
        request_id = request.request_id
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already waiting")
        if self.by_priority:
            key = (request.priority, seq)
            bisect.insort(self._by_seq, (seq, request_id))
        elif front:
            self._num_front += 1
            key = (0, -self._num_front)
        else:
            key = (0, seq)
        self._entries[request_id] = _Entry(request, key, seq, mark)
        bisect.insort(self._by_key, (key, request_id))

    def remove(self, request_id: str) -> Request:
        """Take a waiting request out; KeyError when it is not waiting."""
        entry = self._entries.pop(request_id)
        _delete(self._by_key, (entry.key, request_id))
        if self.by_priority:
            _delete(self._by_seq, (entry.seq, request_id))
        return entry.request

    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order. The queue must not change while this runs."""
        entries = self._entries
        if not self.by_priority:
            for _, request_id in self._by_key:
                yield entries[request_id].request
            return
        threshold = self._promoted_mark
        promoted: set[str] = set()
        for _, request_id in self._by_seq:
            entry = entries[request_id]
            if entry.mark > threshold:
                break  # marks grow with arrival: no later request is promoted either
            promoted.add(request_id)
            yield entry.request
        for _, request_id in self._by_key:
            if request_id not in promoted:
                yield entries[request_id].request

    def overtakes_too_far(self, request: Request, passed: set[str], busy_groups: set[str]) -> bool:
        """Whether admitting ``request`` now would overtake an earlier arrival that has waited
        through ``max_overtakes`` admissions and could run now: not in ``passed`` (admitted or
        set aside this step) nor a member of a group in ``busy_groups`` (which waits for another
        member's prompt anyway). Promotions hold still within a step, so several admissions in
        one step could otherwise push such a request past its bound; the scheduler stops
        admitting instead, and the request is promoted at the next step."""
        if not self.by_priority:
            return False
        due_mark = self.num_admitted - self.max_overtakes
        own_seq = self._entries[request.request_id].seq
        for seq, request_id in self._by_seq:
            entry = self._entries[request_id]
            if seq >= own_seq or entry.mark > due_mark:
                return False  # marks grow with arrival: no later arrival is due either
            if request_id in passed:
                continue
            group_id = entry.request.group_id
            if group_id is None or group_id not in busy_groups:
                return True
        return False

    def first(self) -> Request | None:
        return next(iter(self), None)

    def is_promoted(self, request_id: str) -> bool:
        entry = self._entries[request_id]
        return self.by_priority and entry.mark <= self._promoted_mark

    def check_integrity(self) -> None:
        assert len(self._by_key) == len(self._entries)
        assert self._by_key == sorted(self._by_key)
        assert all(self._entries[i].key == key for key, i in self._by_key)
        if self.by_priority:
            assert self._by_seq == sorted((e.seq, i) for i, e in self._entries.items())
        for request_id, entry in self._entries.items():
            assert entry.request.request_id == request_id


def _delete(items: list[Any], item: object) -> None:
    index = bisect.bisect_left(items, item)
    assert items[index] == item, item
    del items[index]
