"""The Dynamic SplitFuse scheduler: one ragged batch of decode tokens and prompt chunks per step.

Each step has a token budget (``max_batch_tokens``) and a row limit (``max_batch_seqs``):

1. Running requests that are caught up (one token left to compute) decode, oldest first. A decode
   that needs a new block when none is free preempts the newest running request: its blocks are
   freed and it waits at the front of the queue to recompute ``prompt + generated`` tokens.
2. Running requests still in their prompt take ``min(remaining, budget left)`` tokens each.
3. Waiting requests are admitted first come, first served while budget and rows remain, and only
   when blocks for all their tokens are free now (their prefix-cache hit counts as computed). The
   first that does not fit stops admission, so a long prompt is never overtaken. Waiting members
   of a group whose prompt another member is still computing are skipped, not waited for: they
   are admitted once the prompt's full blocks are in the prefix cache.

Policies (``policy``, ``fair_share``):

- ``fcfs`` (default): the order above; ``priority`` is ignored.
- ``priority``: the waiting queue is ordered by ``priority`` (lower first), then arrival, with
  aging: a request that has waited through ``max_overtakes`` admissions since it arrived goes
  first (``scheduler/waiting_queue.py``), so at most ``max_overtakes`` later arrivals are ever
  admitted ahead of it. Running requests decode in the same order, and a decode that needs a block
  preempts the last of them (lowest priority, newest). When the first waiting request does not fit
  in the free blocks, running requests of strictly lower priority are preempted (by recompute;
  lowest priority and newest first) to make room, but only when that makes enough room, and a
  request is preempted this way at most ``max_priority_preemptions`` times: neither a waiting nor a
  running request starves.
- ``fair_share``: the budget left after the decodes is shared between the tenants with prompt work
  (running prompts and waiting requests): each gets an equal share (a tenant that needs less gives
  the rest to the others), tenants that have had the fewest prompt tokens so far go first and take
  the integer remainder, and whatever a tenant cannot use goes to the others (work-conserving).
  Within a tenant the order is the policy's. A request that does not fit in the free blocks stops
  the admission of every request behind it in the queue order, whatever its tenant.

Several decode steps per batch (``max_decode_steps`` > 1): where a batch holds only decodes (no
prompt chunk, nothing waiting), at most ``max_decode_rows`` of them, and every request is plain
greedy (``SamplingParams.plain_greedy``, past its ``min_tokens``) and not streamed, the batch
runs up to ``max_decode_steps`` steps in one pass, each step's sampled token the next step's input
(the runner does not come back to Python between them). The steps are as many as every request can
take before ``max_tokens`` or the pool's length limit, and only where the free blocks hold the
K/V of the tokens sampled on the way (allocated now as lookahead slots); otherwise one.
``update()`` then appends each request's tokens one at a time and stops at the first that ends
it (the rest are dropped, as a later step would never have run). New arrivals wait for the pass:
at most ``max_decode_steps`` steps.

Only the chunk that reaches ``num_tokens`` samples. Worked example, budget 32, 100-token prompt:
four steps run 32, 32, 32 and 4 tokens, and only the last samples.

``num_computed_tokens`` advances in ``schedule()`` (as in vLLM): after ``schedule()`` it counts the
tokens whose K/V will be in the cache once this batch has run. ``update()`` then appends the
sampled tokens and registers the blocks the batch completed in the prefix cache.

A request finishes with ``stop`` on a token in ``stop_token_ids`` or, unless ``ignore_eos``, in its
``eos_token_ids``, once at least ``min_tokens`` other tokens precede it; with ``length`` at
``max_tokens`` outputs, at ``max_model_len`` tokens, or when its next token would need more slots
than the whole pool has (it could never run again). A stop wins over a length on the same token.

Not thread-safe: the engine calls every method from its own loop thread.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from kv_cache import KVCacheManager
from scheduler.batch import BatchRow, NewRequestData, ScheduledBatch
from scheduler.request import Request, RequestStatus
from scheduler.waiting_queue import WaitingQueue

Policy = Literal["fcfs", "priority"]
POLICIES: tuple[Policy, ...] = ("fcfs", "priority")


class Scheduler:
    """Owns the waiting and running requests and their blocks. See the module docstring."""

    def __init__(
        self,
        max_batch_tokens: int,
        max_batch_seqs: int,
        max_model_len: int,
        kv_manager: KVCacheManager,
        policy: Policy = "fcfs",
        fair_share: bool = False,
        max_overtakes: int = 64,
        max_priority_preemptions: int = 1,
        max_decode_steps: int = 1,
        max_decode_rows: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        for name, value, minimum in (
            ("max_batch_tokens", max_batch_tokens, 1),
            ("max_batch_seqs", max_batch_seqs, 1),
            ("max_model_len", max_model_len, 2),
            ("max_overtakes", max_overtakes, 1),
            ("max_priority_preemptions", max_priority_preemptions, 0),
            ("max_decode_steps", max_decode_steps, 1),
            ("max_decode_rows", max_decode_rows, 0),
        ):
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.max_model_len = max_model_len
        self.kv_manager = kv_manager
        self.policy = policy
        self.fair_share = fair_share
        self.max_priority_preemptions = max_priority_preemptions
        # Decode steps a batch of plain greedy decodes may run in one pass, and its most rows.
        self.max_decode_steps = max_decode_steps
        self.max_decode_rows = max_decode_rows
        # A request can hold at most the whole pool: it ends (``length``) once its next token
        # would need a slot beyond it, as it would at max_model_len.
        self._max_num_tokens = min(max_model_len, kv_manager.num_blocks * kv_manager.block_size + 1)
        self._requests: dict[str, Request] = {}  # waiting and running, by id
        self._arrival_order: dict[str, int] = {}  # request id -> order of add_request calls
        self._arrival_mark: dict[str, int] = {}  # request id -> admissions before it arrived
        self._num_added = 0
        self._waiting = WaitingQueue(policy == "priority", max_overtakes)
        # In arrival order (fcfs) or (priority, arrival) order: the last one is preempted first.
        self._running: list[Request] = []
        # Prompt tokens scheduled per tenant with prompt work (fair_share), relative to the least.
        self._served: dict[str, int] = {}
        # Finished or aborted since the previous batch; their ids stay taken until reported.
        self._finished_ids: list[str] = []
        self._finished_id_set: set[str] = set()
        self._last_batch: ScheduledBatch | None = None
        self._num_sampling_rows = 0
        self.num_preemptions = 0

    # -- queries ----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs (finished ids not yet reported do not count)."""
        return bool(self._requests)

    def running_requests(self) -> list[Request]:
        """The running requests, oldest first (a copy)."""
        return list(self._running)

    def waiting_requests(self) -> list[Request]:
        """The waiting queue in admission order (a copy)."""
        return list(self._waiting)

    def get_request(self, request_id: str) -> Request | None:
        """A waiting or running request; None when unknown or finished."""
        return self._requests.get(request_id)

    # -- requests in and out ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError, changing nothing, when its id is taken or its
        prompt can never run (no room for one generated token, or more blocks than the pool)."""
        request_id = request.request_id
        if request_id in self._requests or request_id in self._finished_id_set:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {request_id!r} is not new (status {request.status.name})")
        if request.num_tokens + 1 > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {request.num_tokens} tokens leaves no room "
                f"to generate within max_model_len {self.max_model_len}"
            )
        num_blocks = self.kv_manager.num_blocks_for(request.num_tokens)
        if num_blocks > self.kv_manager.num_blocks:
            raise ValueError(
                f"request {request_id!r}: prompt of {request.num_tokens} tokens needs {num_blocks} "
                f"KV-cache blocks, the pool has {self.kv_manager.num_blocks}"
            )
        self._requests[request_id] = request
        self._arrival_order[request_id] = self._num_added
        self._arrival_mark[request_id] = self._waiting.num_admitted
        self._waiting.push(request, self._num_added, self._waiting.num_admitted)
        self._num_added += 1

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> Request | None:
        """End a waiting or running request now (``status``: FINISHED_ABORTED, or FINISHED_ERROR
        when the engine failed it) and free its blocks. None when unknown or already finished."""
        if not status.finished:
            raise ValueError(f"abort needs a finished status, got {status.name}")
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request_id)
        else:
            self._running.remove(request)
        self._finish(request, status)
        return request

    # -- the step ---------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Choose this step's rows: decodes first, then prompt chunks. The batch may have no rows
        and still carry ``finished_request_ids``."""
        kv = self.kv_manager
        running = self._running
        rows: list[BatchRow] = []
        new_requests: list[NewRequestData] = []
        budget = self.max_batch_tokens
        max_rows = self.max_batch_seqs
        num_preemptions_before = self.num_preemptions
        self._waiting.promote()
        # Admitted by preempting lower priorities: its first chunk runs with the prompt chunks.
        head = self._preempt_for_priority(new_requests) if self.policy == "priority" else None

        # 1. Decodes, in running order; remember requests with a prompt (or a recompute) to run.
        prompt_requests: list[Request] = []
        block_size = kv.block_size
        index = 0
        while index < len(running) and budget > 0 and len(rows) < max_rows:
            request = running[index]
            index += 1
            token_ids = request.token_ids
            position = request.num_computed_tokens
            if len(token_ids) - position != 1 or request is head:
                if len(token_ids) - position > 1 or request is head:
                    prompt_requests.append(request)
                continue
            block_ids = kv.block_ids(request.request_id)
            if len(block_ids) * block_size <= position:  # the token starts a new block
                if not self._allocate_or_preempt(request):
                    break  # the request preempted itself: it was the last, none is left
                block_ids = kv.block_ids(request.request_id)
            rows.append(
                BatchRow(
                    request.request_id,
                    (token_ids[position],),
                    position,
                    block_ids,
                    True,
                    request.num_prompt_tokens,
                )
            )
            request.num_computed_tokens = position + 1
            budget -= 1

        busy_groups = {r.group_id for r in prompt_requests if r.group_id is not None}
        if self.fair_share:
            self._schedule_prompts_fairly(prompt_requests, budget, rows, new_requests, busy_groups)
        else:
            # 2. Prompt chunks of running requests, in running order.
            for request in prompt_requests:
                if budget == 0 or len(rows) >= max_rows:
                    break
                budget -= self._schedule_chunk(request, budget, rows)
            # 3. Admissions in queue order, until the first that does not fit; nothing below
            # changes the waiting queue, so the admitted requests leave it after the loop.
            admitted: list[Request] = []
            passed: set[str] = set()  # admitted or set aside in this loop
            for request in self._waiting:
                if budget == 0 or len(rows) >= max_rows:
                    break
                if request.group_id is not None and request.group_id in busy_groups:
                    passed.add(request.request_id)
                    continue
                if self._waiting.overtakes_too_far(request, passed, busy_groups):
                    break
                if not self._admit(request, new_requests):
                    break
                passed.add(request.request_id)
                admitted.append(request)
                if request.group_id is not None:
                    busy_groups.add(request.group_id)
                budget -= self._schedule_chunk(request, budget, rows)
            for request in admitted:
                self._waiting.remove(request.request_id)

        num_steps = 1
        if self.max_decode_steps > 1 and not prompt_requests and not self._waiting:
            num_steps = self._decode_ahead(rows)
        batch = ScheduledBatch(
            rows=tuple(rows),
            new_requests=tuple(new_requests),
            finished_request_ids=tuple(self._finished_ids),
            num_preempted=self.num_preemptions - num_preemptions_before,
            num_steps=num_steps,
        )
        self._finished_ids.clear()
        self._finished_id_set.clear()
        self._last_batch = batch
        self._num_sampling_rows = sum(1 for row in rows if row.sample)
        return batch

    def update(
        self, batch: ScheduledBatch, sampled_token_ids: Sequence[int] | Sequence[Sequence[int]]
    ) -> list[Request]:
        """Apply one step's results: ``sampled_token_ids`` has one id per sampling row, in row
        order (for a batch of ``num_steps`` > 1: a sequence of ``num_steps`` ids per row, in step
        order). Returns the requests of the sampling rows in row order, with the tokens appended
        (up to the one that ends the request) and the status updated; finished ones have freed
        their blocks. Requests aborted since ``schedule()`` are skipped and their tokens
        dropped. Raises ValueError, changing nothing, on ids that do not match the batch."""
        if batch is not self._last_batch:
            raise ValueError("update() takes the batch of the latest schedule(), once")
        if len(sampled_token_ids) != self._num_sampling_rows:
            raise ValueError(
                f"expected {self._num_sampling_rows} sampled token ids (one per sampling row), "
                f"got {len(sampled_token_ids)}"
            )
        num_steps = batch.num_steps
        if num_steps > 1 and any(
            isinstance(ids, int) or len(ids) != num_steps for ids in sampled_token_ids
        ):
            raise ValueError(f"a batch of {num_steps} steps takes {num_steps} ids per row")
        self._last_batch = None
        kv = self.kv_manager
        block_size = kv.block_size
        requests = self._requests
        running_status = RequestStatus.RUNNING
        now = time.monotonic()
        updated: list[Request] = []
        next_sample = 0
        for row in batch.rows:
            request = requests.get(row.request_id)
            sampled: int | Sequence[int] = -1
            if row.sample:
                sampled = sampled_token_ids[next_sample]
                next_sample += 1
            if request is None or request.status is not running_status:
                continue  # aborted after schedule()
            if not isinstance(sampled, int):  # a batch of several decode steps
                self._append_steps(request, row, sampled, now)
                updated.append(request)
                continue
            token_id = sampled
            end = row.start_pos + len(row.token_ids)
            if end // block_size > row.start_pos // block_size:  # the row completed a block
                kv.cache_blocks(request, end)
            if not row.sample:
                continue
            request.token_ids.append(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            status = self._check_finished(request, token_id)
            if status is not None:
                self._running.remove(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    def _decode_ahead(self, rows: list[BatchRow]) -> int:
        """The decode steps a batch of decodes alone (nothing else waits: the caller's check)
        runs: up to ``max_decode_steps`` where it fits (see the module docstring), with the
        lookahead blocks allocated, the rows' tables extended and ``num_computed_tokens`` past
        the steps; 1 (changing nothing) where it does not."""
        if not rows or len(rows) > self.max_decode_rows:
            return 1
        requests = [self._requests[row.request_id] for row in rows]
        num_steps = self.max_decode_steps
        for row, request in zip(rows, requests, strict=True):
            params = request.sampling_params
            if len(row.token_ids) != 1 or not row.sample or not params.plain_greedy:
                return 1
            if row.start_pos < row.prompt_end:  # a prompt's last token (the rest was cached)
                return 1
            if request.streamed:  # each token leaves a step after the previous
                return 1
            if request.num_output_tokens < params.min_tokens:
                return 1
            # as many tokens as the request may still take (the last step's is not computed)
            num_steps = min(
                num_steps,
                params.max_tokens - request.num_output_tokens,
                self._max_num_tokens - request.num_tokens,
            )
        if num_steps < 2:
            return 1
        kv = self.kv_manager
        num_new_blocks = sum(
            max(0, kv.num_blocks_for(row.start_pos + num_steps) - len(row.block_table))
            for row in rows
        )
        if num_new_blocks > kv.num_free_blocks:
            return 1
        for index, (row, request) in enumerate(zip(rows, requests, strict=True)):
            allocated = kv.allocate_slots(request, 0, num_lookahead_tokens=num_steps - 1)
            assert allocated is not None, request  # counted free above
            if allocated:
                rows[index] = dataclasses.replace(row, block_table=kv.block_ids(row.request_id))
            request.num_computed_tokens = row.start_pos + num_steps
        return num_steps

    def _append_steps(
        self, request: Request, row: BatchRow, token_ids: Sequence[int], now: float
    ) -> None:
        """A row of a batch of several decode steps: its tokens appended one at a time until one
        ends the request (the others are dropped), the blocks it completed cached, then the
        request finished if it ended."""
        status = None
        for token_id in token_ids:
            request.token_ids.append(token_id)
            status = self._check_finished(request, token_id)
            if status is not None:
                break
        if request.first_token_time is None:
            request.first_token_time = now
        # K/V are computed for every position whose token the request now holds
        end = min(row.start_pos + len(token_ids), request.num_tokens)
        if end // self.kv_manager.block_size > row.start_pos // self.kv_manager.block_size:
            self.kv_manager.cache_blocks(request, end)
        if status is not None:
            self._running.remove(request)
            self._finish(request, status)

    # -- integrity --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError when the queues, the requests' counters or the block tables
        disagree with each other or with the pool."""
        kv = self.kv_manager
        kv.check_integrity()
        self._waiting.check_integrity()
        waiting_ids = [r.request_id for r in self._waiting]
        running_ids = [r.request_id for r in self._running]
        assert len(set(waiting_ids) | set(running_ids)) == len(waiting_ids) + len(running_ids)
        assert set(waiting_ids) | set(running_ids) == set(self._requests)
        assert set(self._arrival_order) == set(self._requests) == set(self._arrival_mark)
        keys = [self._running_key(r) for r in self._running]
        assert keys == sorted(keys), "running requests out of order"
        held_block_ids: set[int] = set()
        for request in self._waiting:
            assert request.status is RequestStatus.WAITING, request
            assert request.num_computed_tokens == 0, request
            assert not kv.block_ids(request.request_id), f"{request} holds blocks"
        for request in self._running:
            assert request.status is RequestStatus.RUNNING, request
            assert 0 <= request.num_computed_tokens <= request.num_tokens, request
            assert request.num_tokens <= self._max_num_tokens, request
            num_slots = len(kv.block_ids(request.request_id)) * kv.block_size
            assert num_slots >= max(request.num_computed_tokens, request.num_tokens - 1), request
            held_block_ids.update(kv.block_ids(request.request_id))
        in_use = {b for b in range(kv.num_blocks) if kv.pool.ref_count(b) > 0}
        assert held_block_ids == in_use, "blocks in use that no running request holds"

    # -- internals --------------------------------------------------------------------------------

    def _running_key(self, request: Request) -> tuple[int, int]:
        """Decode order: arrival (fcfs), or priority then arrival."""
        order = self._arrival_order[request.request_id]
        return (request.priority, order) if self.policy == "priority" else (0, order)

    def _admit(self, request: Request, new_requests: list[NewRequestData]) -> bool:
        """Allocate blocks for all of a waiting request's tokens (its cached prefix counts as
        computed) and make it run; False, changing nothing, when they do not fit now. The caller
        takes it out of the waiting queue."""
        kv = self.kv_manager
        computed_blocks, num_cached_tokens = kv.get_computed_blocks(request)
        num_new_tokens = request.num_tokens - num_cached_tokens
        if kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
            return False
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached_tokens
        bisect.insort(self._running, request, key=self._running_key)
        self._waiting.num_admitted += 1
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_cached_tokens
            new_requests.append(
                NewRequestData(
                    request.request_id,
                    tuple(request.prompt_token_ids),
                    request.sampling_params,
                    request.eos_token_ids,
                )
            )
        return True

    def _num_blocks_to_admit(self, request: Request) -> int:
        """Free blocks the request's admission would take now (its cached prefix aside)."""
        kv = self.kv_manager
        computed_blocks, _ = kv.get_computed_blocks(request)
        num_evictable = sum(1 for b in computed_blocks if kv.pool.ref_count(b) == 0)
        return kv.num_blocks_for(request.num_tokens) - len(computed_blocks) + num_evictable

    def _preempt_for_priority(self, new_requests: list[NewRequestData]) -> Request | None:
        """When the first waiting request does not fit in the free blocks, preempt running
        requests of strictly lower priority (the last in running order first) until it does, and
        admit it. Nothing happens unless preempting every such request would make room; a
        request already preempted ``max_priority_preemptions`` times this way is spared. Returns
        the request admitted, if any."""
        head = self._waiting.first()
        if head is None:
            return None
        kv = self.kv_manager
        if self._num_blocks_to_admit(head) <= kv.num_free_blocks:
            return None  # admitted the usual way, if the budget allows
        if head.group_id is not None and any(r.group_id == head.group_id for r in self._running):
            return None  # a sibling computes the shared prompt: it waits for its cached blocks
        victims = [
            r
            for r in self._running
            if r.priority > head.priority
            and r.num_priority_preemptions < self.max_priority_preemptions
        ]
        if not victims:
            return None
        # Blocks the victims alone hold come free (shared prefix blocks may stay held).
        holds = Counter(b for r in victims for b in kv.block_ids(r.request_id))
        num_freed = sum(1 for b, n in holds.items() if kv.pool.ref_count(b) == n)
        if self._num_blocks_to_admit(head) > kv.num_free_blocks + num_freed:
            return None
        for victim in reversed(victims):
            self._running.remove(victim)
            self._preempt(victim)
            victim.num_priority_preemptions += 1
            if self._num_blocks_to_admit(head) <= kv.num_free_blocks:
                break
        if not self._admit(head, new_requests):
            return None
        self._waiting.remove(head.request_id)
        return head

    def _schedule_prompts_fairly(
        self,
        prompt_requests: list[Request],
        budget: int,
        rows: list[BatchRow],
        new_requests: list[NewRequestData],
        busy_groups: set[str],
    ) -> None:
        """Prompt chunks and admissions under ``fair_share``: the budget split between tenants
        with prompt work (see the module docstring)."""
        # Each tenant's work in order: its running prompts, then its waiting requests; a waiting
        # request's position in the queue decides which blocked admission stops it.
        work: dict[str, list[tuple[int, Request]]] = {}
        for request in prompt_requests:
            work.setdefault(request.tenant, []).append((-1, request))
        if budget > 0 and len(rows) < self.max_batch_seqs:
            for position, request in enumerate(self._waiting):
                work.setdefault(request.tenant, []).append((position, request))
        served = self._served
        for tenant in [t for t in served if t not in work]:
            del served[tenant]  # idle: no credit carried into its next burst
        floor = min(served.values(), default=0)
        for tenant in work:
            served[tenant] = served.get(tenant, floor) - floor
        if budget == 0 or len(rows) >= self.max_batch_seqs:
            return
        order = sorted(work, key=lambda t: (served[t], t))
        shares = _water_fill(budget, order, {t: _demand(work[t], budget) for t in order})
        progress = {tenant: 0 for tenant in order}  # next item of each tenant's work
        cut: dict[str, int] = {}  # tenant -> index in rows of its row cut short by its share
        admitted: list[Request] = []
        blocked = [len(self._waiting)]  # queue position of the first admission refused

        def run(tenant: str, allowance: int) -> int:
            used = 0
            items = work[tenant]
            if tenant in cut and allowance > 0:
                used += self._extend_chunk(cut.pop(tenant), allowance, rows)
            while progress[tenant] < len(items) and used < allowance:
                if len(rows) >= self.max_batch_seqs:
                    break
                position, request = items[progress[tenant]]
                if position >= 0:  # waiting
                    if position > blocked[0]:
                        break
                    if request.group_id is not None and request.group_id in busy_groups:
                        progress[tenant] += 1
                        continue
                    if not self._admit(request, new_requests):
                        blocked[0] = min(blocked[0], position)
                        break
                    admitted.append(request)
                    if request.group_id is not None:
                        busy_groups.add(request.group_id)
                num_tokens = self._schedule_chunk(request, allowance - used, rows)
                used += num_tokens
                if request.num_computed_tokens < request.num_tokens:
                    cut[tenant] = len(rows) - 1
                progress[tenant] += 1
            return used

        for tenant in order:
            used = run(tenant, shares[tenant])
            budget -= used
            served[tenant] += used
        for tenant in order:  # what a tenant could not use goes to the others
            if budget == 0:
                break
            used = run(tenant, budget)
            budget -= used
            served[tenant] += used
        for request in admitted:
            self._waiting.remove(request.request_id)

    def _extend_chunk(self, row_index: int, max_tokens: int, rows: list[BatchRow]) -> int:
        """Grow the prompt chunk at ``rows[row_index]`` by at most ``max_tokens``; return by how
        many tokens (a request has one row per step, so a chunk cut short is extended)."""
        row = rows[row_index]
        request = self._requests[row.request_id]
        start = request.num_computed_tokens
        num_tokens = min(request.num_tokens - start, max_tokens)
        end = start + num_tokens
        request.num_computed_tokens = end
        rows[row_index] = BatchRow(
            row.request_id,
            row.token_ids + tuple(request.token_ids[start:end]),
            row.start_pos,
            row.block_table,
            end == request.num_tokens,
            row.prompt_end,
        )
        return num_tokens

    def _schedule_chunk(self, request: Request, budget: int, rows: list[BatchRow]) -> int:
        """Append the request's next prompt chunk (at most ``budget`` tokens); return its size."""
        start = request.num_computed_tokens
        num_tokens = min(request.num_tokens - start, budget)
        end = start + num_tokens
        block_ids = self.kv_manager.block_ids(request.request_id)
        # Blocks for all of the request's tokens were allocated on admission.
        assert len(block_ids) * self.kv_manager.block_size >= end, request
        request.num_computed_tokens = end
        rows.append(
            BatchRow(
                request.request_id,
                tuple(request.token_ids[start:end]),
                start,
                block_ids,
                end == request.num_tokens,
                request.num_prompt_tokens,
            )
        )
        return num_tokens

    def _allocate_or_preempt(self, request: Request) -> bool:
        """Allocate a block for a decode, preempting the newest running requests until one is
        free. False when the request itself was the newest and got preempted."""
        while self.kv_manager.allocate_slots(request, 1) is None:
            victim = self._running.pop()  # the last; it has no row in this batch yet
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it first, to recompute all its tokens."""
        self.kv_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request_id = request.request_id
        self._waiting.push(
            request, self._arrival_order[request_id], self._arrival_mark[request_id], front=True
        )

    def _check_finished(self, request: Request, token_id: int) -> RequestStatus | None:
        """The finish status after ``token_id`` was appended, or None. A stop token counts only
        after ``min_tokens`` other outputs; a stop wins over ``length`` on the same token."""
        params = request.sampling_params
        num_tokens = len(request.token_ids)
        num_output_tokens = num_tokens - request.num_prompt_tokens
        if token_id in request.stop_ids and num_output_tokens > params.min_tokens:
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= params.max_tokens or num_tokens >= self._max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark a request finished (already out of the queues), free its blocks, forget it."""
        request.status = status
        self.kv_manager.free(request)
        del self._requests[request.request_id]
        del self._arrival_order[request.request_id]
        del self._arrival_mark[request.request_id]
        self._finished_ids.append(request.request_id)
        self._finished_id_set.add(request.request_id)


def _demand(work: list[tuple[int, Request]], limit: int) -> int:
    """Prompt tokens a tenant's work could take, counted up to ``limit``."""
    total = 0
    for _, request in work:
        total += request.num_tokens - request.num_computed_tokens
        if total >= limit:
            return limit
    return total


def _water_fill(budget: int, order: list[str], demands: dict[str, int]) -> dict[str, int]:
    """Max-min fair shares of ``budget``: equal shares, a tenant that needs less than its share
    gives the rest to the others; the integer remainder goes one token each to the first tenants
    of ``order`` that can use it. Worked example, budget 10, demands a=2, b=9, c=9 (order a b c):
    a gets 2, then b and c split 8 -> {a: 2, b: 4, c: 4}; budget 11 -> {a: 2, b: 5, c: 4}."""
    shares = dict.fromkeys(order, 0)
    remaining = budget
    by_demand = sorted(order, key=lambda t: demands[t])
    for index, tenant in enumerate(by_demand):
        num_left = len(by_demand) - index
        if demands[tenant] * num_left <= remaining:
            shares[tenant] = demands[tenant]
            remaining -= demands[tenant]
            continue
        level = remaining // num_left  # every tenant left needs more than this
        for other in by_demand[index:]:
            shares[other] = level
        remaining -= level * num_left
        break
    for tenant in order:
        if remaining == 0:
            break
        if shares[tenant] < demands[tenant]:
            shares[tenant] += 1
            remaining -= 1
    return shares
