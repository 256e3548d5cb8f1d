"""KVCacheManager: block tables, allocation that fits or changes nothing, prefix caching; and
hypothesis state-machine tests over random admit / append / share prefix / free / preempt. Then
the KV tensor's memory: committed when it is allocated, and a budget that does not fit refused."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import engine.kv_cache_memory as kv_memory
from kv_cache import KVCacheManager, RequestStateError
from scheduler import Request, SamplingParams

PARAMS = SamplingParams()


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, PARAMS)


def admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    blocks, num_cached = kv.get_computed_blocks(request)
    new_blocks = kv.allocate_slots(request, request.num_tokens - num_cached, blocks)
    if new_blocks is not None:
        request.num_computed_tokens = num_cached
    return new_blocks


def compute_all(kv: KVCacheManager, request: Request) -> None:
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_tokens)


def test_allocate_slots_grows_the_table_only_at_block_boundaries():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", list(range(6)))
    assert kv.allocate_slots(request, 6) == [0, 1]
    assert kv.block_table("a") == [0, 1]
    request.num_computed_tokens = 6
    request.token_ids += [6, 7]
    assert kv.allocate_slots(request, 2) == []  # positions 6, 7 fit in block 1
    request.num_computed_tokens = 8
    request.token_ids.append(8)
    assert kv.allocate_slots(request, 1) == [2]
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.usage == pytest.approx(0.75)
    kv.check_integrity()


def test_allocate_slots_returns_none_and_changes_nothing_when_blocks_do_not_fit():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8) == [0, 1]
    second = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(second, 8) is None
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.check_integrity()


def test_slots_beyond_the_requests_tokens_are_misuse():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    request = make_request("a", [1, 2, 3])
    with pytest.raises(RequestStateError):
        kv.allocate_slots(request, 4)
    with pytest.raises(ValueError):
        kv.allocate_slots(request, -1)
    assert kv.num_free_blocks == 3


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(10)))  # blocks: 0-3 | 4-7 | 8-9
    assert admit(kv, first) == [0, 1, 2]
    compute_all(kv, first)
    assert kv.prefix_cache_queries == 10 and kv.prefix_cache_hits == 0

    second = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, num_cached = kv.get_computed_blocks(second)
    assert (blocks, num_cached) == ([0, 1], 8)
    assert kv.allocate_slots(second, 3, blocks) == [3]
    assert kv.block_table("b") == [0, 1, 3]
    assert kv.prefix_cache_queries == 21 and kv.prefix_cache_hits == 8

    # Exactly the cached 8 tokens: only one block may be reused, the last token is recomputed.
    third = make_request("c", list(range(8)))
    assert kv.get_computed_blocks(third) == ([0], 4)
    # A different first block: no hit even though the second block's tokens match.
    fourth = make_request("d", [99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.get_computed_blocks(fourth) == ([], 0)
    kv.free(third)
    kv.free(fourth)
    kv.check_integrity()


@pytest.mark.parametrize("generated_apart", [False, True])
def test_generated_tokens_kv_serves_a_prompt_that_repeats_them_only_where_kinds_do_not_matter(
    generated_apart,
):
    """With ``generated_apart`` (prompt and generated tokens computed apart: AMX tiles), a block
    holding generated tokens does not serve a prompt that repeats them; the prompt's own full
    blocks are shared as before, and a request of the same prompt and generated tokens (a
    preempted request) finds them all."""
    kv = KVCacheManager(num_blocks=16, block_size=4, generated_apart=generated_apart)
    first = make_request("a", list(range(6)))  # prompt 0-5: blocks 0-3 | 4-5 ..
    assert admit(kv, first) == [0, 1]
    compute_all(kv, first)
    first.token_ids.extend([6, 7, 8, 9])  # generated: positions 6-9
    assert kv.allocate_slots(first, 4) == [2]
    compute_all(kv, first)  # full blocks 0-3, 4-7 (two generated), 8-11 not full

    chat = make_request("b", list(range(10)))  # a prompt repeating the generated tokens
    assert kv.get_computed_blocks(chat) == (([0], 4) if generated_apart else ([0, 1], 8))
    again = make_request("a2", list(range(6)))  # the same prompt, the same generated tokens
    again.token_ids.extend([6, 7, 8, 9])
    assert kv.get_computed_blocks(again) == ([0, 1], 8)
    kv.free(first)
    kv.check_integrity()


def test_freed_blocks_stay_cached_and_the_prefix_is_evicted_last():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    first = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(kv, first)
    compute_all(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    # Blocks were freed last-first; one new block evicts the unused one, then the tail.
    other = make_request("b", [9, 9, 9])
    assert kv.allocate_slots(other, 3) == [3, 2]
    again = make_request("c", [1, 2, 3, 4, 5, 6, 7])
    assert kv.get_computed_blocks(again) == ([0, 1], 4)
    kv.check_integrity()


def test_a_cached_prefix_outlives_churn_through_uncached_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    first = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, first)
    compute_all(kv, first)  # blocks 0, 1 cached; 2 holds the fifth token
    kv.free(first)
    for index in range(50):  # five uncached blocks are free: each request takes two of them
        other = make_request(f"other-{index}", [100 + index] * 3)
        assert set(kv.allocate_slots(other, 3)).isdisjoint({0, 1})
        kv.free(other)
    again = make_request("c", [1, 2, 3, 4, 9])
    assert kv.get_computed_blocks(again) == ([0, 1], 4)
    kv.check_integrity()


def test_sharing_a_free_cached_block_counts_against_free_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    first = make_request("a", [1, 2, 3])
    admit(kv, first)
    compute_all(kv, first)
    kv.free(first)  # both blocks free, block 0 cached
    second = make_request("b", [1, 2, 7, 8, 9])
    blocks, num_cached = kv.get_computed_blocks(second)
    assert (blocks, num_cached) == ([0], 2)
    # Needs block 0 (free, cached) plus two new blocks: three of two free.
    assert kv.allocate_slots(second, 3, blocks) is None
    assert kv.num_free_blocks == 2 and kv.block_table("b") == []
    kv.check_integrity()


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    first = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, first)
    compute_all(kv, first)
    second = make_request("b", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(second) == ([], 0)
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0
    assert kv.pool.num_cached_blocks == 0


def test_free_of_a_request_without_blocks_is_a_no_op():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.free(make_request("never", [1]))
    assert kv.num_free_blocks == 2


# -- property tests -------------------------------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 12
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny vocab: prefixes repeat


class ManagerMachine(RuleBasedStateMachine):
    """A model KV store records, for every written slot, the token prefix its K/V stands for; a
    prefix-cache hit must find exactly the request's own prefix there."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.live: dict[str, Request] = {}  # holding blocks, all tokens computed
        self.parked: dict[str, Request] = {}  # preempted: no blocks, waits to recompute
        self.kv_store: dict[int, tuple[int, ...]] = {}  # slot -> prefix whose K/V is there
        self.num_added = 0
        self.last_counters = (0, 0)

    def _write(self, request: Request, end: int) -> None:
        table = self.kv.block_table(request.request_id)
        assert len(table) * BLOCK_SIZE >= end
        for position in range(request.num_computed_tokens, end):
            block_id = table[position // BLOCK_SIZE]
            # Writes only ever go into a block this request holds alone.
            assert self.kv.pool.ref_count(block_id) == 1
            assert self.kv.pool.block_hash(block_id) is None
            slot = block_id * BLOCK_SIZE + position % BLOCK_SIZE
            self.kv_store[slot] = tuple(request.token_ids[: position + 1])
        request.num_computed_tokens = end
        self.kv.cache_blocks(request, end)

    def _admit(self, request: Request) -> bool:
        blocks, num_cached = self.kv.get_computed_blocks(request)
        assert num_cached == len(blocks) * BLOCK_SIZE < request.num_tokens
        for position in range(num_cached):
            slot = blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            assert self.kv_store[slot] == tuple(request.token_ids[: position + 1])
        num_free = self.kv.num_free_blocks
        new_blocks = self.kv.allocate_slots(request, request.num_tokens - num_cached, blocks)
        if new_blocks is None:
            assert self.kv.num_free_blocks == num_free
            assert self.kv.block_table(request.request_id) == []
            return False
        assert self.kv.block_table(request.request_id) == blocks + new_blocks
        request.num_computed_tokens = num_cached
        self._write(request, request.num_tokens)
        return True

    def _park(self, request_id: str) -> None:
        request = self.live.pop(request_id)
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.parked[request_id] = request

    @rule(token_ids=tokens)
    def admit_new(self, token_ids: list[int]) -> None:
        request = make_request(f"r{self.num_added}", token_ids)
        self.num_added += 1
        if self._admit(request):
            self.live[request.request_id] = request
        else:
            self.kv.free(request)  # drop the memoized hashes

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tail=tokens)
    def admit_sharing_a_prefix(self, data: st.DataObject, tail: list[int]) -> None:
        source = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        cut = data.draw(st.integers(1, source.num_tokens))
        self.admit_new(source.token_ids[:cut] + tail)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new_tokens=tokens)
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live[request_id]
        request.token_ids.extend(new_tokens)
        if self.kv.allocate_slots(request, len(new_tokens)) is None:
            self._park(request_id)  # out of blocks: preempted, recomputes later
        else:
            self._write(request, request.num_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(request_id))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._park(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.parked)))
        request = self.parked[request_id]
        if self._admit(request):
            self.live[request_id] = self.parked.pop(request_id)
        else:
            self.kv.free(request)

    @invariant()
    def invariants_hold(self) -> None:
        self.kv.check_integrity()
        holders: dict[int, int] = {}
        for request_id in self.live:
            for block_id in self.kv.block_table(request_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id, count in holders.items():
            assert self.kv.pool.ref_count(block_id) == count
            if count > 1:  # shared only through the prefix cache
                assert self.kv.pool.block_hash(block_id) is not None
        assert self.kv.num_free_blocks == NUM_BLOCKS - len(holders)
        for request_id in self.parked:
            assert self.kv.block_table(request_id) == []
        counters = (self.kv.prefix_cache_queries, self.kv.prefix_cache_hits)
        assert counters[0] >= self.last_counters[0] and counters[1] >= self.last_counters[1]
        assert counters[1] <= counters[0]
        self.last_counters = counters

    def teardown(self) -> None:
        for request in [*self.live.values(), *self.parked.values()]:
            self.kv.free(request)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert self.kv.usage == 0.0
        self.kv.check_integrity()


ManagerMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerMachine = ManagerMachine.TestCase


# -- the KV tensor's memory -----------------------------------------------------------------------


def resident_bytes_of(tensor: torch.Tensor) -> int:
    """Resident bytes of the mappings that hold ``tensor``'s memory, from /proc/self/smaps (the
    cache's huge-page advice splits its mapping in up to three). The process's total would also
    move with whatever other threads allocate or free meanwhile."""
    begin = tensor.data_ptr()
    end = begin + tensor.nbytes
    resident, inside, found = 0, False, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                start, stop = (int(bound, 16) for bound in first.split("-"))
                inside = start < end and begin < stop
                found = found or inside
            elif inside and first == "Rss:":
                resident += int(line.split()[1]) * 1024
    assert found, "no mapping holds the tensor"
    return resident


def test_the_kv_cache_is_resident_as_soon_as_it_is_allocated():
    # 4 layers x 2 x 16 tokens x 4 KV heads x 64 x 4 bytes = 128 KiB per block; 1,024 blocks
    num_bytes = kv_memory.bytes_per_block(4, 16, 4, 64, torch.float32) * 1024
    assert num_bytes == 128 * 2**20
    cache = kv_memory.allocate_kv_cache(4, 1024, 16, 4, 64, torch.float32, torch.device("cpu"))
    resident = resident_bytes_of(cache)
    assert resident >= num_bytes, f"{resident / 2**20:.0f} MiB of a 128 MiB cache are resident"
    assert cache.shape == (4, 2, 1024, 16, 4, 64) and not cache.any()


def test_a_cache_larger_than_free_memory_is_refused_naming_budget_free_memory_and_setting(
    monkeypatch,
):
    monkeypatch.setattr(kv_memory, "free_memory_bytes", lambda device: 100 * 2**20)
    empty = torch.empty
    shapes = []

    def recording_empty(*shape, **kwargs):
        shapes.append(shape[0] if len(shape) == 1 else shape)
        return empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    with pytest.raises(ValueError) as refused:
        kv_memory.allocate_kv_cache(4, 1024, 16, 4, 64, torch.float32, torch.device("cpu"))
    message = str(refused.value)
    assert "the KV-cache budget of 128 MiB (1024 blocks) does not fit" in message
    assert "100 MiB of memory is free on cpu" in message
    assert "lower kv_cache_memory" in message
    assert (4, 2, 1024, 16, 4, 64) not in shapes  # refused before anything was allocated
    # What fits is allocated.
    cache = kv_memory.allocate_kv_cache(4, 512, 16, 4, 64, torch.float32, torch.device("cpu"))
    assert cache.shape == (4, 2, 512, 16, 4, 64)
    assert (4, 2, 512, 16, 4, 64) in shapes


def test_lookahead_slots_cover_positions_past_the_tokens():
    """Several decode steps in one pass write the K/V of tokens sampled on the way: room for
    them beyond the request's tokens, allocated whole or not at all."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", list(range(6)))
    assert kv.allocate_slots(request, 6) == [0, 1]
    request.num_computed_tokens = 6
    request.token_ids.append(6)
    # position 6 and 4 lookahead positions (7 .. 10): block 2 too
    assert kv.allocate_slots(request, 1, num_lookahead_tokens=4) == [2]
    request.num_computed_tokens = 7
    assert kv.allocate_slots(request, 0, num_lookahead_tokens=1) == []  # position 7: in block 1
    assert kv.allocate_slots(request, 0, num_lookahead_tokens=10) is None  # 5 blocks: no room
    assert kv.block_table("a") == [0, 1, 2] and kv.num_free_blocks == 1
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        kv.allocate_slots(request, 0, num_lookahead_tokens=-1)
    kv.check_integrity()
