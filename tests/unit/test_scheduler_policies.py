"""Scheduler policies, worked by hand: priority order and its aging bound, preemption in favour of
a higher priority (and its once-only bound), fair sharing of the prompt budget between tenants."""

from __future__ import annotations

import pytest

from kv_cache import KVCacheManager
from scheduler import Request, RequestStatus, SamplingParams, Scheduler
from scheduler.scheduler import _water_fill
from scheduler.waiting_queue import WaitingQueue
from tests.unit.test_scheduler import shape, step

EOS = 2


def make(
    policy: str = "priority",
    fair_share: bool = False,
    budget: int = 32,
    num_blocks: int = 64,
    block_size: int = 16,
    max_seqs: int = 8,
    **kwargs: int,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(budget, max_seqs, 1024, kv, policy, fair_share, **kwargs)  # type: ignore[arg-type]


def add(
    scheduler: Scheduler,
    request_id: str,
    num_tokens: int,
    priority: int = 0,
    tenant: str = "",
    max_tokens: int = 100,
) -> Request:
    # distinct first token per request: no prefix-cache hits between them
    token_ids = [1000 + len(scheduler.waiting_requests()) * 7 + hash(request_id) % 5000]
    token_ids += list(range(100, 100 + num_tokens - 1))
    request = Request(
        request_id,
        token_ids,
        SamplingParams(max_tokens=max_tokens),
        eos_token_ids=(EOS,),
        priority=priority,
        tenant=tenant,
    )
    scheduler.add_request(request)
    return request


def test_priority_admits_lower_values_first_then_arrival() -> None:
    scheduler = make(budget=8)
    for request_id, priority in (("a", 5), ("b", 0), ("c", -1), ("d", 0)):
        add(scheduler, request_id, 4, priority)
    assert [r.request_id for r in scheduler.waiting_requests()] == ["c", "b", "d", "a"]
    batch, _ = step(scheduler)
    assert [row.request_id for row in batch.rows] == ["c", "b"]
    # running requests decode in the same order
    batch, _ = step(scheduler)
    assert [row.request_id for row in batch.rows][:2] == ["c", "b"]


def test_fcfs_ignores_priority() -> None:
    scheduler = make(policy="fcfs", budget=8)
    add(scheduler, "a", 4, priority=5)
    add(scheduler, "b", 4, priority=-3)
    assert [r.request_id for r in scheduler.waiting_requests()] == ["a", "b"]


def test_aging_promotes_a_request_after_max_overtakes_admissions() -> None:
    scheduler = make(budget=4, max_overtakes=2)
    add(scheduler, "a", 4, priority=5)
    for request_id in "bcd":
        add(scheduler, request_id, 4, priority=0)
    order = [[r.request_id for r in scheduler.waiting_requests()]]
    for _ in range(3):
        step(scheduler)
        order.append([r.request_id for r in scheduler.waiting_requests()])
    # promotions take effect when a step starts: "a" goes ahead of "d" in the third
    assert order == [["b", "c", "d", "a"], ["c", "d", "a"], ["d", "a"], ["d"]]


def test_waiting_queue_rejects_bad_settings_and_duplicates() -> None:
    with pytest.raises(ValueError, match="max_overtakes"):
        WaitingQueue(True, 0)
    queue = WaitingQueue(True, 4)
    request = Request("x", [1, 2], SamplingParams())
    queue.push(request, 0, 0)
    with pytest.raises(ValueError, match="already waiting"):
        queue.push(request, 0, 0)


def test_bad_policy_and_priority_are_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        make(policy="lifo")
    with pytest.raises(ValueError, match="priority must be an integer"):
        Request("x", [1], SamplingParams(), priority="1")  # type: ignore[arg-type]


def test_a_higher_priority_request_preempts_a_lower_one_once() -> None:
    # 8 blocks of 16 tokens: "low" holds 5, "high" needs 4 (only 3 are free).
    scheduler = make(budget=128, num_blocks=8)
    low = add(scheduler, "low", 80, priority=5)
    step(scheduler)
    assert low.status is RequestStatus.RUNNING
    high = add(scheduler, "high", 64, priority=0)
    batch, _ = step(scheduler)
    assert batch.num_preempted == 1 and low.status is RequestStatus.WAITING
    assert low.num_priority_preemptions == 1
    assert shape(batch) == [("high", 0, 64, True)]
    # "high" finishes; "low" runs again and is spared by the next high-priority arrival.
    scheduler.abort("high")
    step(scheduler)
    assert low.status is RequestStatus.RUNNING
    add(scheduler, "high2", 64, priority=0)
    batch, _ = step(scheduler)
    assert batch.num_preempted == 0 and low.status is RequestStatus.RUNNING
    assert [r.request_id for r in scheduler.waiting_requests()] == ["high2"]
    assert high.status is RequestStatus.FINISHED_ABORTED


def test_no_preemption_that_would_not_make_room() -> None:
    scheduler = make(budget=128, num_blocks=8)
    add(scheduler, "low", 32, priority=5)  # 2 blocks
    add(scheduler, "mid", 64, priority=0)  # 4 blocks, not lower than "big"
    step(scheduler)
    add(scheduler, "big", 112, priority=0)  # needs 7: freeing "low" leaves 4
    batch, _ = step(scheduler)
    assert batch.num_preempted == 0
    assert [r.request_id for r in scheduler.waiting_requests()] == ["big"]


def test_equal_priority_never_preempts() -> None:
    scheduler = make(budget=128, num_blocks=8)
    add(scheduler, "first", 80, priority=0)
    step(scheduler)
    add(scheduler, "second", 64, priority=0)
    batch, _ = step(scheduler)
    assert batch.num_preempted == 0


def test_water_fill_worked_examples() -> None:
    demands = {"a": 2, "b": 9, "c": 9}
    assert _water_fill(10, ["a", "b", "c"], demands) == {"a": 2, "b": 4, "c": 4}
    assert _water_fill(11, ["a", "b", "c"], demands) == {"a": 2, "b": 5, "c": 4}
    assert _water_fill(11, ["c", "b", "a"], demands) == {"a": 2, "b": 4, "c": 5}
    assert _water_fill(100, ["a", "b"], {"a": 3, "b": 4}) == {"a": 3, "b": 4}
    assert _water_fill(1, ["a", "b"], {"a": 3, "b": 4}) == {"a": 1, "b": 0}


def test_fair_share_splits_the_prompt_budget_between_tenants() -> None:
    scheduler = make(policy="fcfs", fair_share=True, budget=32)
    for index in range(3):
        add(scheduler, f"flood{index}", 200, tenant="a")
    small = add(scheduler, "small", 10, tenant="b")
    batch, _ = step(scheduler)
    # "b" needs 10 of its 16: "a" gets the other 22, cut short (extended within the step).
    assert sorted(shape(batch)) == [("flood0", 0, 22, False), ("small", 0, 10, True)]
    assert small.num_output_tokens == 1
    batch, _ = step(scheduler)
    assert [(r.request_id, r.num_tokens) for r in batch.rows] == [("small", 1), ("flood0", 31)]


def test_fair_share_alternates_the_remainder_and_shares_equally() -> None:
    scheduler = make(policy="fcfs", fair_share=True, budget=33, num_blocks=512)
    for tenant in "ab":
        for index in range(4):
            add(scheduler, f"{tenant}{index}", 300, tenant=tenant, max_tokens=1)
    totals = {"a": 0, "b": 0}
    for _ in range(20):
        batch, _ = step(scheduler)
        for row in batch.rows:
            totals[row.request_id[0]] += row.num_tokens
    assert totals == {"a": 330, "b": 330}


def test_fair_share_a_blocked_admission_stops_later_arrivals_of_every_tenant() -> None:
    scheduler = make(policy="fcfs", fair_share=True, budget=64, num_blocks=6)
    add(scheduler, "held", 64, tenant="a")  # 4 blocks
    step(scheduler)
    add(scheduler, "big", 48, tenant="b")  # 3 blocks: only 2 free
    add(scheduler, "later", 16, tenant="c")  # 1 block would fit, but arrived after "big"
    batch, _ = step(scheduler)
    assert [r.request_id for r in batch.rows] == ["held"]
    assert [r.request_id for r in scheduler.waiting_requests()] == ["big", "later"]
