"""Scheduler worked examples: chunking, packing, preemption, prefix hits, groups, aborts and the
finish rules. No model: tokens are chosen by the test."""

import time

import pytest

from kv_cache import KVCacheManager
from scheduler import Request, RequestStatus, SamplingParams, ScheduledBatch, Scheduler

EOS = 2


def make_scheduler(
    budget: int = 32,
    max_seqs: int = 8,
    max_model_len: int = 1024,
    num_blocks: int = 64,
    block_size: int = 16,
    prefix_caching: bool = True,
) -> Scheduler:
    kv_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(budget, max_seqs, max_model_len, kv_manager)


def add(
    scheduler: Scheduler,
    request_id: str,
    prompt: int | list[int],
    group_id: str | None = None,
    **params: object,
) -> Request:
    token_ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 100)
    request = Request(
        request_id, token_ids, SamplingParams(**params), eos_token_ids=(EOS,), group_id=group_id
    )
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, token_id: int = 7) -> tuple[ScheduledBatch, list[Request]]:
    batch = scheduler.schedule()
    sampled = [token_id] * len(batch.sample_request_ids)
    updated = scheduler.update(batch, sampled)
    scheduler.check_integrity()
    return batch, updated


def shape(batch: ScheduledBatch) -> list[tuple[str, int, int, bool]]:
    return [(r.request_id, r.start_pos, r.num_tokens, r.sample) for r in batch.rows]


def test_a_long_prompt_runs_in_budget_sized_chunks_and_samples_on_the_last():
    scheduler = make_scheduler(budget=32)
    request = add(scheduler, "a", 100)
    shapes, new_ids = [], []
    for _ in range(4):
        batch, updated = step(scheduler, token_id=42)
        shapes += shape(batch)
        new_ids += [n.request_id for n in batch.new_requests]
    assert shapes == [
        ("a", 0, 32, False),
        ("a", 32, 32, False),
        ("a", 64, 32, False),
        ("a", 96, 4, True),
    ]
    assert new_ids == ["a"]
    assert updated == [request] and request.output_token_ids == [42]
    assert request.first_scheduled_time is not None and request.first_token_time is not None
    # Then one decode token per step: the last token at position num_tokens - 1.
    batch = scheduler.schedule()
    [row] = batch.rows
    assert (row.token_ids, row.start_pos, row.sample) == ((42,), 100, True)
    assert len(row.block_table) == 7  # 101 tokens in blocks of 16
    scheduler.update(batch, [43])
    assert request.output_token_ids == [42, 43]


def test_decodes_go_first_and_prompt_chunks_fill_the_budget_exactly():
    scheduler = make_scheduler(budget=16)
    add(scheduler, "a", 5)
    add(scheduler, "b", 6)
    batch, _ = step(scheduler)
    assert shape(batch) == [("a", 0, 5, True), ("b", 0, 6, True)]
    add(scheduler, "c", 40)
    add(scheduler, "d", 3)
    batch, _ = step(scheduler)
    assert shape(batch) == [("a", 5, 1, True), ("b", 6, 1, True), ("c", 0, 14, False)]
    batch, _ = step(scheduler)
    # c continues before d is admitted; d fills the rest and is not split.
    assert shape(batch) == [
        ("a", 6, 1, True),
        ("b", 7, 1, True),
        ("c", 14, 14, False),
    ]
    batch, _ = step(scheduler)
    assert shape(batch) == [
        ("a", 7, 1, True),
        ("b", 8, 1, True),
        ("c", 28, 12, True),
        ("d", 0, 2, False),
    ]
    assert batch.num_tokens == 16


def test_short_prompts_are_packed_until_the_budget_is_used():
    scheduler = make_scheduler(budget=32)
    for request_id, length in (("a", 10), ("b", 10), ("c", 20)):
        add(scheduler, request_id, length)
    batch, _ = step(scheduler)
    assert shape(batch) == [("a", 0, 10, True), ("b", 0, 10, True), ("c", 0, 12, False)]
    assert [n.request_id for n in batch.new_requests] == ["a", "b", "c"]


def test_the_row_limit_holds():
    scheduler = make_scheduler(budget=64, max_seqs=2)
    for request_id in "abc":
        add(scheduler, request_id, 4)
    batch, _ = step(scheduler)
    assert [r.request_id for r in batch.rows] == ["a", "b"]
    batch, _ = step(scheduler)
    assert [r.request_id for r in batch.rows] == ["a", "b"]
    assert scheduler.num_waiting == 1


def test_admission_waits_for_blocks_for_the_whole_prompt_and_keeps_fcfs():
    scheduler = make_scheduler(budget=64, num_blocks=4, block_size=4)
    add(scheduler, "a", 8)  # 2 blocks
    add(scheduler, "b", 12)  # 3 blocks: must wait
    add(scheduler, "c", 2)  # would fit, but b is first
    batch, _ = step(scheduler)
    assert [r.request_id for r in batch.rows] == ["a"]
    assert scheduler.num_waiting == 2


def test_a_decode_without_a_free_block_preempts_the_newest_request():
    scheduler = make_scheduler(budget=64, num_blocks=4, block_size=4, prefix_caching=False)
    add(scheduler, "old", 7)  # 2 blocks
    new = add(scheduler, "new", 8)  # 2 blocks: the pool is full
    step(scheduler, token_id=11)
    # old decodes position 7 (its block 1 has room); new needs a third block for position 8,
    # none is free, and new is the newest: it preempts itself.
    batch, _ = step(scheduler, token_id=12)
    assert shape(batch) == [("old", 7, 1, True)] and batch.num_preempted == 1
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert scheduler.kv_manager.block_table("new") == []
    # new needs 3 blocks for its 9 tokens, 1 is free after old takes its third: it waits.
    batch, _ = step(scheduler, token_id=13)
    assert shape(batch) == [("old", 8, 1, True)] and scheduler.num_waiting == 1
    scheduler.abort("old")
    # The preempted request recomputes prompt + generated tokens as a prompt; it is not new again.
    batch = scheduler.schedule()
    assert shape(batch) == [("new", 0, 9, True)]
    assert batch.new_requests == () and batch.finished_request_ids == ("old",)
    assert batch.rows[0].token_ids == (*range(100, 108), 11)
    scheduler.update(batch, [14])
    assert new.output_token_ids == [11, 14]
    scheduler.check_integrity()


def test_the_newest_running_request_is_preempted_for_an_older_decode():
    scheduler = make_scheduler(budget=64, num_blocks=5, block_size=4, prefix_caching=False)
    old = add(scheduler, "old", 8)  # 2 blocks, its first decode needs a third
    mid = add(scheduler, "mid", 4)  # 1 block
    new = add(scheduler, "new", 8)  # 2 blocks: the pool is full
    step(scheduler)
    batch, _ = step(scheduler)
    assert batch.num_preempted == 1 and new.status is RequestStatus.WAITING
    assert [r.request_id for r in batch.rows] == ["old", "mid"]
    assert old.status is mid.status is RequestStatus.RUNNING


def test_an_admitted_request_starts_from_its_cached_prefix():
    scheduler = make_scheduler(budget=64, block_size=16)
    prompt = list(range(1000, 1040))
    first = add(scheduler, "a", prompt)
    step(scheduler)
    assert first.num_cached_tokens == 0
    second = add(scheduler, "b", prompt[:32] + [5, 6, 7])
    batch, _ = step(scheduler)
    assert shape(batch)[-1] == ("b", 32, 3, True)
    assert second.num_cached_tokens == 32
    kv = scheduler.kv_manager
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.prefix_cache_hits == 32 and kv.prefix_cache_queries == 40 + 35


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler(budget=64, block_size=4)
    prompt = list(range(1000, 1008))
    add(scheduler, "a", prompt)
    step(scheduler)
    second = add(scheduler, "b", prompt)
    batch, updated = step(scheduler, token_id=9)
    assert shape(batch)[-1] == ("b", 4, 4, True)
    assert second.num_cached_tokens == 4 and updated[-1] is second


def test_group_members_wait_for_the_first_to_cache_the_prompt_without_blocking_others():
    scheduler = make_scheduler(budget=16, block_size=4)
    prompt = list(range(500, 530))  # 30 tokens: 2 chunks of 16 + 14
    first = add(scheduler, "g0", prompt, group_id="g")
    second = add(scheduler, "g1", prompt, group_id="g")
    add(scheduler, "other", 3)
    batch, _ = step(scheduler)
    assert shape(batch) == [("g0", 0, 16, False)]
    batch, _ = step(scheduler)
    # g0 finishes its prompt; g1 is skipped, "other" behind it is admitted.
    assert shape(batch) == [("g0", 16, 14, True), ("other", 0, 2, False)]
    batch, _ = step(scheduler)
    assert second.status is RequestStatus.RUNNING
    assert second.num_cached_tokens == 28  # 7 full blocks of 4 computed by g0
    assert ("g1", 28, 2, True) in shape(batch)
    assert first.num_output_tokens == 2


def test_abort_of_waiting_and_running_requests_frees_blocks_and_reports_once():
    scheduler = make_scheduler(budget=8, num_blocks=8, block_size=4)
    running = add(scheduler, "run", 20)
    waiting = add(scheduler, "wait", 4)
    step(scheduler)
    assert running.status is RequestStatus.RUNNING and scheduler.num_waiting == 1
    assert scheduler.kv_manager.num_free_blocks == 3
    assert scheduler.abort("wait") is waiting
    assert scheduler.abort("run") is running
    assert running.status is waiting.status is RequestStatus.FINISHED_ABORTED
    assert running.finish_reason == "abort"
    assert scheduler.kv_manager.num_free_blocks == 8
    assert scheduler.abort("run") is None and scheduler.abort("unknown") is None
    assert not scheduler.has_unfinished() and scheduler.get_request("run") is None
    # The ids stay taken until the runner has been told.
    with pytest.raises(ValueError, match="already in use"):
        add(scheduler, "run", 3)
    batch = scheduler.schedule()
    assert batch.is_empty and batch.finished_request_ids == ("wait", "run")
    scheduler.update(batch, [])
    assert scheduler.schedule().finished_request_ids == ()
    scheduler.check_integrity()


def test_a_request_aborted_between_schedule_and_update_is_skipped():
    scheduler = make_scheduler()
    first = add(scheduler, "a", 3)
    second = add(scheduler, "b", 3)
    batch = scheduler.schedule()
    scheduler.abort("a")
    updated = scheduler.update(batch, [5, 6])
    assert updated == [second] and second.output_token_ids == [6]
    assert first.output_token_ids == []
    assert scheduler.schedule().finished_request_ids == ("a",)


def test_eos_ends_a_request_only_after_min_tokens_outputs():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 3, min_tokens=2)
    for _ in range(2):
        step(scheduler, token_id=EOS)
        assert request.status is RequestStatus.RUNNING
    _, updated = step(scheduler, token_id=EOS)
    assert updated == [request]
    assert request.status is RequestStatus.FINISHED_STOPPED and request.finish_reason == "stop"
    assert request.stop_token_id == EOS and request.output_token_ids == [EOS] * 3
    assert scheduler.kv_manager.num_free_blocks == 64


def test_ignore_eos_runs_to_max_tokens():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 3, ignore_eos=True, max_tokens=4)
    for _ in range(4):
        step(scheduler, token_id=EOS)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [EOS] * 4 and request.stop_token_id is None


def test_stop_token_ids_end_a_request():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 3, stop_token_ids=(77,), ignore_eos=True)
    step(scheduler, token_id=EOS)
    step(scheduler, token_id=77)
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.stop_token_id == 77 and request.output_token_ids == [EOS, 77]


def test_max_model_len_ends_a_request_with_length():
    scheduler = make_scheduler(max_model_len=6)
    request = add(scheduler, "a", 4, max_tokens=50)
    step(scheduler)
    step(scheduler)
    assert request.num_tokens == 6 and request.status is RequestStatus.FINISHED_LENGTH


def test_a_request_ends_with_length_when_the_next_token_would_not_fit_in_the_pool():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    request = add(scheduler, "a", 7, max_tokens=50)
    for _ in range(2):
        step(scheduler)
    assert request.num_tokens == 9 and request.status is RequestStatus.FINISHED_LENGTH
    assert not scheduler.has_unfinished()


def test_add_request_rejects_what_can_never_run_and_changes_nothing():
    scheduler = make_scheduler(max_model_len=64, num_blocks=2, block_size=16)
    add(scheduler, "a", 3)
    with pytest.raises(ValueError, match="already in use"):
        add(scheduler, "a", 3)
    with pytest.raises(ValueError, match="max_model_len"):
        add(scheduler, "long", 64)
    with pytest.raises(ValueError, match="blocks"):
        add(scheduler, "big", 33)
    assert scheduler.num_waiting == 1 and scheduler.get_request("long") is None
    scheduler.check_integrity()


def test_update_rejects_a_wrong_number_of_tokens_or_a_stale_batch():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 3)
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="expected 1"):
        scheduler.update(batch, [])
    assert request.output_token_ids == []
    scheduler.update(batch, [5])
    with pytest.raises(ValueError, match="latest schedule"):
        scheduler.update(batch, [5])
    assert request.output_token_ids == [5]


def test_constructor_rejects_bad_limits():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Scheduler(0, 8, 64, KVCacheManager(4, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(8, 8, 1, KVCacheManager(4, 4))


def test_aborting_many_waiting_requests_is_constant_time_each_and_keeps_the_order():
    scheduler = make_scheduler(budget=8, max_seqs=4)
    params = SamplingParams(max_tokens=4)
    num_requests = 20_000
    for i in range(num_requests):
        scheduler.add_request(Request(f"r{i}", [100 + i % 50, 7, 8], params))
    # Newest first, every other one: the worst order for a search from the front (a deque took
    # over a second here; by id it takes milliseconds).
    start = time.perf_counter()
    for i in range(num_requests - 1, -1, -2):
        assert scheduler.abort(f"r{i}") is not None
    assert time.perf_counter() - start < 0.5
    kept = [f"r{i}" for i in range(0, num_requests, 2)]
    assert scheduler.num_waiting == len(kept)
    assert [r.request_id for r in scheduler.waiting_requests()] == kept
    scheduler.check_integrity()
    batch, _ = step(scheduler)
    # 3-token prompts, budget 8: two whole prompts and a chunk of the third, oldest first.
    assert shape(batch) == [("r0", 0, 3, True), ("r2", 0, 3, True), ("r4", 0, 2, False)]
    assert len(batch.finished_request_ids) == num_requests // 2
    assert [r.request_id for r in scheduler.waiting_requests()] == kept[3:]


def test_a_preempted_request_goes_back_in_front_of_the_waiting_ones():
    scheduler = make_scheduler(budget=64, num_blocks=4, block_size=4, prefix_caching=False)
    add(scheduler, "old", 7)  # 2 blocks
    add(scheduler, "new", 8)  # 2 blocks: the pool is full
    step(scheduler)
    add(scheduler, "later", 3)
    add(scheduler, "last", 3)
    scheduler.abort("later")
    batch, _ = step(scheduler)  # new preempts itself for old's decode
    assert batch.num_preempted == 1
    assert [r.request_id for r in scheduler.waiting_requests()] == ["new", "last"]


# -- several decode steps per batch ---------------------------------------------------------------


def ahead_scheduler(num_blocks: int = 64, max_steps: int = 4, max_rows: int = 8) -> Scheduler:
    kv_manager = KVCacheManager(num_blocks, 4)
    return Scheduler(64, 8, 1024, kv_manager, max_decode_steps=max_steps, max_decode_rows=max_rows)


def test_plain_greedy_decodes_run_several_steps_with_lookahead_blocks():
    scheduler = ahead_scheduler()
    a = add(scheduler, "a", 6, temperature=0.0, max_tokens=20)
    b = add(scheduler, "b", 3, temperature=0.0, max_tokens=20)
    batch, _ = step(scheduler)  # the prompts: one step
    assert batch.num_steps == 1
    batch = scheduler.schedule()
    assert batch.num_steps == 4 and shape(batch) == [("a", 6, 1, True), ("b", 3, 1, True)]
    # positions 6 .. 9 and 3 .. 6: the tables cover them
    assert [len(row.block_table) for row in batch.rows] == [3, 2]
    updated = scheduler.update(batch, [[11, 12, 13, 14], [21, 22, 23, 24]])
    scheduler.check_integrity()
    assert updated == [a, b]
    assert a.output_token_ids == [7, 11, 12, 13, 14] and b.output_token_ids == [7, 21, 22, 23, 24]
    assert a.num_computed_tokens == a.num_tokens - 1 == 10
    batch = scheduler.schedule()
    assert batch.num_steps == 4 and shape(batch) == [("a", 10, 1, True), ("b", 7, 1, True)]


def test_rows_say_where_their_requests_prompt_ends_and_a_prompts_last_token_runs_alone():
    # "b" repeats "a"'s 9-token prompt: 8 tokens come from the prefix cache and its last prompt
    # token is scheduled as one token, as a decode is; it is still a prompt token (prompt_end 9),
    # so that step runs one step, not several
    scheduler = ahead_scheduler()
    a = add(scheduler, "a", 9, temperature=0.0, max_tokens=1)
    batch, _ = step(scheduler)
    assert [(r.request_id, r.prompt_end) for r in batch.rows] == [("a", 9)]
    assert a.finish_reason == "length"
    add(scheduler, "b", 9, temperature=0.0, max_tokens=20)
    batch, _ = step(scheduler)
    assert shape(batch) == [("b", 8, 1, True)] and batch.rows[0].prompt_end == 9
    assert batch.num_steps == 1
    batch = scheduler.schedule()  # b's generated tokens decode ahead
    assert batch.num_steps == 4 and batch.rows[0].prompt_end == 9
    assert shape(batch) == [("b", 9, 1, True)]


def test_a_token_that_ends_a_request_drops_the_rest_of_its_steps():
    scheduler = ahead_scheduler()
    a = add(scheduler, "a", 4, temperature=0.0, max_tokens=20)
    b = add(scheduler, "b", 4, temperature=0.0, max_tokens=20, stop_token_ids=(9,))
    step(scheduler)
    batch = scheduler.schedule()
    assert batch.num_steps == 4
    updated = scheduler.update(batch, [[11, EOS, 12, 13], [21, 22, 9, 23]])
    scheduler.check_integrity()
    assert updated == [a, b]
    assert a.output_token_ids == [7, 11, EOS] and a.finish_reason == "stop"
    assert b.output_token_ids == [7, 21, 22, 9] and b.stop_token_id == 9
    assert scheduler.kv_manager.num_free_blocks == 64  # both freed, lookahead blocks too
    assert not scheduler.has_unfinished()


def test_the_steps_stop_at_max_tokens_and_the_length_limit():
    scheduler = ahead_scheduler()
    a = add(scheduler, "a", 4, temperature=0.0, max_tokens=3)
    step(scheduler)  # the first output token
    batch = scheduler.schedule()
    assert batch.num_steps == 2  # outputs 2 and 3
    scheduler.update(batch, [[5, 6]])
    assert a.finish_reason == "length" and a.output_token_ids == [7, 5, 6]
    long = make_scheduler(max_model_len=8)
    long.max_decode_steps, long.max_decode_rows = 4, 8
    b = add(long, "b", 5, temperature=0.0, max_tokens=100)
    step(long)
    batch = long.schedule()
    assert batch.num_steps == 2  # 6 tokens: 2 more reach max_model_len
    long.update(batch, [[5, 6]])
    assert b.finish_reason == "length" and b.num_tokens == 8


@pytest.mark.parametrize(
    "case",
    [
        dict(temperature=1.0),
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.0, logit_bias={5: 1.0}),
        dict(temperature=0.0, presence_penalty=0.5),
        dict(temperature=0.0, min_tokens=3),
    ],
    ids=["random", "logprobs", "logit_bias", "penalties", "min_tokens"],
)
def test_one_step_unless_every_request_is_plain_greedy(case):
    scheduler = ahead_scheduler()
    add(scheduler, "a", 4, temperature=0.0)
    add(scheduler, "b", 4, **case)
    step(scheduler)
    assert scheduler.schedule().num_steps == 1


def test_one_step_while_a_prompt_waits_or_runs_or_rows_or_blocks_run_short():
    scheduler = ahead_scheduler()
    add(scheduler, "a", 4, temperature=0.0)
    step(scheduler)
    add(scheduler, "b", 4, temperature=0.0)
    batch, _ = step(scheduler)  # b's prompt beside a's decode
    assert batch.num_steps == 1
    assert scheduler.schedule().num_steps == 4
    rows = ahead_scheduler(max_rows=1)
    for request_id in "ab":
        add(rows, request_id, 4, temperature=0.0)
    step(rows)
    assert rows.schedule().num_steps == 1
    # 4 blocks of 4, all held: a's prompt of 6 and b's of 5 take two each; their next tokens
    # (positions 6 and 5) fit, a's steps to position 9 would need a fifth block
    blocks = ahead_scheduler(num_blocks=4)
    add(blocks, "a", 6, temperature=0.0)
    add(blocks, "b", 5, temperature=0.0)
    step(blocks)
    assert blocks.kv_manager.num_free_blocks == 0
    batch = blocks.schedule()
    assert batch.num_steps == 1 and blocks.kv_manager.num_free_blocks == 0


def test_an_update_with_one_id_per_row_for_several_steps_is_refused():
    scheduler = ahead_scheduler()
    a = add(scheduler, "a", 4, temperature=0.0)
    step(scheduler)
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="4 ids per row"):
        scheduler.update(batch, [[11, 12]])
    assert a.output_token_ids == [7]
    scheduler.update(batch, [[11, 12, 13, 14]])
    assert a.output_token_ids == [7, 11, 12, 13, 14]


def test_one_step_while_a_streamed_request_runs():
    scheduler = ahead_scheduler()
    add(scheduler, "a", 4, temperature=0.0)
    streamed = Request("b", [5, 6, 7], SamplingParams(temperature=0.0), streamed=True)
    scheduler.add_request(streamed)
    step(scheduler)
    assert scheduler.schedule().num_steps == 1
