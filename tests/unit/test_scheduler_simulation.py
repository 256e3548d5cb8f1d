"""Simulation tier: a fake runner drives the real scheduler over thousands of random requests with
a pool small enough to force preemption, checking every step and, at the end, that every request
got exactly what it would get with an unlimited pool.

The fake model: the next token is a function of a rolling hash of all tokens so far. The runner
keeps a model KV cache (one slot per block position holding the prefix hash whose K/V is there)
and checks that every row reads the right prefix through its block table, so a block handed to two
requests, a stale prefix-cache hit or a wrong position shows up as a wrong read.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kv_cache import KVCacheManager
from scheduler import Request, RequestStatus, SamplingParams, ScheduledBatch, Scheduler

VOCAB = 512
EOS = 0
HASH_MODULUS = (1 << 61) - 1
NUM_REQUESTS = 2000
MAX_PROMPT = 4096
MAX_OUTPUT = 512
MAX_MODEL_LEN = 4400
BLOCK_SIZE = 16
NUM_BLOCKS = 300  # 4,800 slots: one longest request fits, a handful of average ones do
BUDGET = 256
MAX_SEQS = 24


def roll(prefix_hash: int, token_id: int) -> int:
    return (prefix_hash * 1_000_003 + token_id + 1) % HASH_MODULUS


def next_token(prefix_hash: int) -> int:
    return (prefix_hash >> 7) % VOCAB


def reference_output(request: Request, max_model_len: int) -> tuple[list[int], str]:
    """What the request gets run alone with an unlimited pool (the finish rules, restated)."""
    params = request.sampling_params
    prefix_hash = 0
    for token_id in request.prompt_token_ids:
        prefix_hash = roll(prefix_hash, token_id)
    output: list[int] = []
    while True:
        token_id = next_token(prefix_hash)
        prefix_hash = roll(prefix_hash, token_id)
        output.append(token_id)
        is_stop = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in request.eos_token_ids
        )
        if is_stop and len(output) > params.min_tokens:
            return output, "stop"
        if len(output) >= params.max_tokens or request.num_prompt_tokens + len(output) >= (
            max_model_len
        ):
            return output, "length"


@dataclass
class _Sequence:
    token_ids: list[int]
    prefix_hashes: list[int] = field(default_factory=list)  # [i]: hash of token_ids[: i + 1]

    def hash_at(self, position: int) -> int:
        while len(self.prefix_hashes) <= position:
            parent = self.prefix_hashes[-1] if self.prefix_hashes else 0
            self.prefix_hashes.append(roll(parent, self.token_ids[len(self.prefix_hashes)]))
        return self.prefix_hashes[position]


class FakeRunner:
    """Sees only batches, like the engine's runner; samples from the prefix hash."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_slots = [-1] * (num_blocks * block_size)  # slot -> prefix hash written there
        self.sequences: dict[str, _Sequence] = {}
        self.ever_seen: set[str] = set()

    def _slot(self, block_table: tuple[int, ...], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def execute(self, batch: ScheduledBatch) -> list[int]:
        for request_id in batch.finished_request_ids:
            self.sequences.pop(request_id, None)
        for new in batch.new_requests:
            assert new.request_id not in self.ever_seen, "a request was sent as new twice"
            self.ever_seen.add(new.request_id)
            self.sequences[new.request_id] = _Sequence(list(new.prompt_token_ids))
        # Every row writes its K/V before any row reads (one layer's store, then attention).
        for row in batch.rows:
            sequence = self.sequences[row.request_id]
            end = row.start_pos + row.num_tokens
            assert list(row.token_ids) == sequence.token_ids[row.start_pos : end]
            assert len(row.block_table) * self.block_size >= end
            for position in range(row.start_pos, end):
                self.kv_slots[self._slot(row.block_table, position)] = sequence.hash_at(position)
        sampled = []
        for row in batch.rows:
            sequence = self.sequences[row.request_id]
            end = row.start_pos + row.num_tokens
            # Reads: the previous position, and the last slot of every block before the row.
            positions = {row.start_pos - 1} if row.start_pos else set()
            if row.num_tokens > 1:
                positions.update(range(self.block_size - 1, row.start_pos, self.block_size))
            for position in positions:
                slot = self._slot(row.block_table, position)
                assert self.kv_slots[slot] == sequence.hash_at(position), (
                    f"{row.request_id}: position {position} reads another prefix's K/V"
                )
            if row.sample:
                assert end == len(sequence.token_ids)
                token_id = next_token(sequence.hash_at(end - 1))
                sequence.token_ids.append(token_id)
                sampled.append(token_id)
        return sampled


def _random_request(rng: random.Random, index: int, prompts: list[list[int]]) -> list[Request]:
    """One request, an n > 1 group sharing a prompt, or a repeat of an earlier prompt."""

    def log_uniform(high: int) -> int:
        return min(high, int(math.exp(rng.uniform(0, math.log(high + 1)))))

    params = {"max_tokens": log_uniform(MAX_OUTPUT)}
    if rng.random() < 0.2:
        params["min_tokens"] = rng.randint(0, params["max_tokens"])
    if rng.random() < 0.2:
        params["ignore_eos"] = True
    if rng.random() < 0.2:
        params["stop_token_ids"] = (rng.randrange(VOCAB),)
    kind = rng.random()
    if kind < 0.1 and prompts:
        prompt, count, group_id = list(rng.choice(prompts)), 1, None
    else:
        length = rng.choice((1, MAX_PROMPT)) if rng.random() < 0.02 else log_uniform(MAX_PROMPT)
        prompt = [rng.randrange(1, VOCAB) for _ in range(length)]
        count, group_id = 1, None
        if kind > 0.9:
            count, group_id = rng.randint(2, 4), f"group{index}"
        else:
            prompts.append(prompt)
    return [
        Request(
            f"req{index}-{member}",
            prompt,
            SamplingParams(**params),
            eos_token_ids=(EOS,),
            group_id=group_id,
        )
        for member in range(count)
    ]


def _check_step(
    scheduler: Scheduler,
    batch: ScheduledBatch,
    before: dict[str, tuple[RequestStatus, int, int, int]],
) -> None:
    """Per-step rules; ``before`` holds (status, num_tokens, num_computed_tokens,
    num_preemptions) per running request as they were before ``schedule()``."""
    kv = scheduler.kv_manager
    assert batch.num_tokens <= BUDGET
    assert batch.num_rows <= MAX_SEQS
    request_ids = [row.request_id for row in batch.rows]
    assert len(set(request_ids)) == len(request_ids), "a request twice in one step"

    busy_groups = set()
    seen_chunk = False
    for index, row in enumerate(batch.rows):
        request = scheduler.get_request(row.request_id)
        assert request is not None and request.status is RequestStatus.RUNNING
        status, num_tokens, num_computed, num_preemptions = before.get(
            row.request_id, (RequestStatus.WAITING, request.num_tokens, 0, request.num_preemptions)
        )
        # A request preempted in this step may be admitted again at once, from its cached prefix.
        is_decode = (
            status is RequestStatus.RUNNING
            and num_tokens - num_computed == 1
            and request.num_preemptions == num_preemptions
        )
        if is_decode:
            assert not seen_chunk, "a decode row after a prompt chunk"
            assert row.num_tokens == 1 and row.start_pos == num_tokens - 1 and row.sample
            continue
        seen_chunk = True
        remaining = num_tokens - row.start_pos
        if request.group_id is not None:
            busy_groups.add(request.group_id)
        if row.num_tokens < remaining:  # split: only when the budget ran out at this row
            assert index == batch.num_rows - 1 and batch.num_tokens == BUDGET
        assert row.sample == (row.num_tokens == remaining)

    if batch.num_tokens < BUDGET and batch.num_rows < MAX_SEQS:
        # Nothing runnable may be left behind: every running request is in the batch ...
        for request_id, (status, num_tokens, num_computed, _) in before.items():
            if status is RequestStatus.RUNNING and num_tokens - num_computed > 1:
                request = scheduler.get_request(request_id)
                if request is not None and request.group_id is not None:
                    busy_groups.add(request.group_id)
        running_ids = {
            request_id
            for request_id, (status, num_tokens, num_computed, _) in before.items()
            if status is RequestStatus.RUNNING
            and num_tokens > num_computed
            and scheduler.get_request(request_id) is not None
            and scheduler.get_request(request_id).status is RequestStatus.RUNNING
        }
        assert running_ids <= set(request_ids)
        # ... and the first admissible waiting request does not fit in the free blocks.
        for request in scheduler.waiting_requests():
            if request.group_id in busy_groups:
                continue
            blocks, _ = kv.get_computed_blocks(request)
            num_evictable = sum(1 for b in blocks if kv.pool.ref_count(b) == 0)
            num_needed = kv.num_blocks_for(request.num_tokens) - len(blocks) + num_evictable
            assert num_needed > kv.num_free_blocks, f"{request} fits but was not admitted"
            break


def test_simulation_matches_an_unlimited_pool_and_keeps_every_rule():
    rng = random.Random(1234)
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    scheduler = Scheduler(BUDGET, MAX_SEQS, MAX_MODEL_LEN, kv)
    runner = FakeRunner(NUM_BLOCKS, BLOCK_SIZE)
    prompts: list[list[int]] = []
    requests: dict[str, Request] = {}
    live: dict[str, Request] = {}  # waiting or running
    arrival: list[str] = []
    first_token_step: dict[str, int] = {}
    aborted: set[str] = set()
    num_added = 0
    step = 0
    while num_added < NUM_REQUESTS or scheduler.has_unfinished():
        if num_added < NUM_REQUESTS and (scheduler.num_waiting < 4 or rng.random() < 0.3):
            for request in _random_request(rng, num_added, prompts):
                scheduler.add_request(request)
                requests[request.request_id] = live[request.request_id] = request
                arrival.append(request.request_id)
            num_added += 1
        if live and rng.random() < 0.02:
            victim = live.pop(rng.choice(list(live)))
            assert scheduler.abort(victim.request_id) is victim
            aborted.add(victim.request_id)

        before = {
            r.request_id: (r.status, r.num_tokens, r.num_computed_tokens, r.num_preemptions)
            for r in scheduler.running_requests()
        }
        batch = scheduler.schedule()
        _check_step(scheduler, batch, before)
        sampled = runner.execute(batch)
        if batch.rows and rng.random() < 0.01:  # abort between schedule() and update()
            victim_id = rng.choice(batch.rows).request_id
            scheduler.abort(victim_id)
            aborted.add(victim_id)
            del live[victim_id]
        updated = scheduler.update(batch, sampled)
        assert [r.request_id for r in updated] == [
            row.request_id for row in batch.rows if row.sample and row.request_id not in aborted
        ]
        for request in updated:
            first_token_step.setdefault(request.request_id, step)
            if request.finished:
                del live[request.request_id]
        step += 1
        if step % 200 == 0:
            scheduler.check_integrity()
        assert step < 200_000, "the simulation does not make progress"

    scheduler.check_integrity()
    assert kv.num_free_blocks == NUM_BLOCKS and kv.usage == 0.0
    assert scheduler.num_running == scheduler.num_waiting == 0
    assert scheduler.num_preemptions > 50, "the pool never forced preemption"
    assert kv.prefix_cache_hits > 0
    assert len(aborted) > 10

    reasons = set()
    for request_id, request in requests.items():
        expected, reason = reference_output(request, MAX_MODEL_LEN)
        if request_id in aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected, request
            assert request.finish_reason == reason, request
            reasons.add(reason)
    assert reasons == {"stop", "length"}

    # First come, first served: among equal prompts, first tokens come in arrival order.
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for request_id in arrival:
        if request_id in first_token_step and request_id not in aborted:
            key = tuple(requests[request_id].prompt_token_ids)
            by_prompt.setdefault(key, []).append(first_token_step[request_id])
    repeated = [steps for steps in by_prompt.values() if len(steps) > 1]
    assert len(repeated) > 20
    for steps in repeated:
        assert steps == sorted(steps)
