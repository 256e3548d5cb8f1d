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
import time
from collections import OrderedDict
from collections.abc import Sequence

from kv_cache import KVCacheManager
from scheduler.batch import BatchRow, NewRequestData, ScheduledBatch
from scheduler.request import Request, RequestStatus


class Scheduler:
    """Owns the waiting and running requests and their blocks. See the module docstring."""

    def __init__(
        self,
        max_batch_tokens: int,
        max_batch_seqs: int,
        max_model_len: int,
        kv_manager: KVCacheManager,
    ) -> None:
        for name, value, minimum in (
            ("max_batch_tokens", max_batch_tokens, 1),
            ("max_batch_seqs", max_batch_seqs, 1),
            ("max_model_len", max_model_len, 2),
        ):
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.max_model_len = max_model_len
        self.kv_manager = kv_manager
        # A request can hold at most the whole pool: it ends (``length``) once its next token
        # would need a slot beyond it, as it would at max_model_len.
        self._max_num_tokens = min(max_model_len, kv_manager.num_blocks * kv_manager.block_size + 1)
        self._requests: dict[str, Request] = {}  # waiting and running, by id
        self._arrival_order: dict[str, int] = {}  # request id -> order of add_request calls
        self._num_added = 0
        # FCFS, by id, so that an abort takes it out in O(1); preempted requests go to the front.
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: list[Request] = []  # in arrival order: the last one is preempted first
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
        return list(self._waiting.values())

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
        self._num_added += 1
        self._waiting[request_id] = request

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
            del self._waiting[request_id]
        else:
            self._running.remove(request)
        self._finish(request, status)
        return request

    # -- the step ---------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Choose this step's rows: decodes first (oldest first), then prompt chunks. The batch
        may have no rows and still carry ``finished_request_ids``."""
        kv = self.kv_manager
        running = self._running
        rows: list[BatchRow] = []
        new_requests: list[NewRequestData] = []
        budget = self.max_batch_tokens
        max_rows = self.max_batch_seqs
        num_preemptions_before = self.num_preemptions

        # 1. Decodes, oldest first; remember requests with a prompt (or a recompute) to run.
        prompt_requests: list[Request] = []
        block_size = kv.block_size
        index = 0
        while index < len(running) and budget > 0 and len(rows) < max_rows:
            request = running[index]
            index += 1
            token_ids = request.token_ids
            position = request.num_computed_tokens
            if len(token_ids) - position != 1:
                if len(token_ids) - position > 1:
                    prompt_requests.append(request)
                continue
            block_ids = kv.block_ids(request.request_id)
            if len(block_ids) * block_size <= position:  # the token starts a new block
                if not self._allocate_or_preempt(request):
                    break  # the request preempted itself: it was the newest, none is left
                block_ids = kv.block_ids(request.request_id)
            rows.append(
                BatchRow(request.request_id, (token_ids[position],), position, block_ids, True)
            )
            request.num_computed_tokens = position + 1
            budget -= 1

        # 2. Prompt chunks of running requests, in arrival order.
        busy_groups = {r.group_id for r in prompt_requests if r.group_id is not None}
        for request in prompt_requests:
            if budget == 0 or len(rows) >= max_rows:
                break
            budget -= self._schedule_chunk(request, budget, rows)

        # 3. Admissions, first come first served; nothing below changes the waiting queue, so the
        # admitted requests leave it after the loop.
        admitted_ids: list[str] = []
        for request in self._waiting.values():
            if budget == 0 or len(rows) >= max_rows:
                break
            if request.group_id is not None and request.group_id in busy_groups:
                continue
            computed_blocks, num_cached_tokens = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_cached_tokens
            if kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                break
            admitted_ids.append(request.request_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached_tokens
            bisect.insort(running, request, key=self._arrival_key)
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
            if request.group_id is not None:
                busy_groups.add(request.group_id)
            budget -= self._schedule_chunk(request, budget, rows)
        for request_id in admitted_ids:
            del self._waiting[request_id]

        batch = ScheduledBatch(
            rows=tuple(rows),
            new_requests=tuple(new_requests),
            finished_request_ids=tuple(self._finished_ids),
            num_preempted=self.num_preemptions - num_preemptions_before,
        )
        self._finished_ids.clear()
        self._finished_id_set.clear()
        self._last_batch = batch
        self._num_sampling_rows = sum(1 for row in rows if row.sample)
        return batch

    def update(self, batch: ScheduledBatch, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Apply one step's results: ``sampled_token_ids`` has one id per sampling row, in row
        order. Returns the requests of the sampling rows in row order, with the token appended
        and the status updated; finished ones have freed their blocks. Requests aborted since
        ``schedule()`` are skipped and their tokens dropped."""
        if batch is not self._last_batch:
            raise ValueError("update() takes the batch of the latest schedule(), once")
        if len(sampled_token_ids) != self._num_sampling_rows:
            raise ValueError(
                f"expected {self._num_sampling_rows} sampled token ids (one per sampling row), "
                f"got {len(sampled_token_ids)}"
            )
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
            token_id = -1
            if row.sample:
                token_id = sampled_token_ids[next_sample]
                next_sample += 1
            if request is None or request.status is not running_status:
                continue  # aborted after schedule()
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

    # -- integrity --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError when the queues, the requests' counters or the block tables
        disagree with each other or with the pool."""
        kv = self.kv_manager
        kv.check_integrity()
        assert all(i == r.request_id for i, r in self._waiting.items())
        waiting_ids = list(self._waiting)
        running_ids = [r.request_id for r in self._running]
        assert len(set(waiting_ids) | set(running_ids)) == len(waiting_ids) + len(running_ids)
        assert set(waiting_ids) | set(running_ids) == set(self._requests)
        assert set(self._arrival_order) == set(self._requests)
        orders = [self._arrival_order[i] for i in running_ids]
        assert orders == sorted(orders), "running requests out of arrival order"
        held_block_ids: set[int] = set()
        for request in self._waiting.values():
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

    def _arrival_key(self, request: Request) -> int:
        return self._arrival_order[request.request_id]

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
            )
        )
        return num_tokens

    def _allocate_or_preempt(self, request: Request) -> bool:
        """Allocate a block for a decode, preempting the newest running requests until one is
        free. False when the request itself was the newest and got preempted."""
        while self.kv_manager.allocate_slots(request, 1) is None:
            victim = self._running.pop()  # the newest; it has no row in this batch yet
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
        self._waiting[request.request_id] = request
        self._waiting.move_to_end(request.request_id, last=False)

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
        self._finished_ids.append(request.request_id)
        self._finished_id_set.add(request.request_id)
