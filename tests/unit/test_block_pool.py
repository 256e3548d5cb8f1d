"""BlockPool: ref counts, the free stack and the cached free queue (LRU), prefix-cache map, and
typed errors on misuse."""

import pytest

from kv_cache import (
    BlockPool,
    BlockStateError,
    DoubleFreeError,
    OutOfBlocksError,
    UnknownBlockError,
    hash_block_tokens,
)


def snapshot(pool: BlockPool) -> tuple:
    return (
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        [pool.block_hash(b) for b in range(pool.num_blocks)],
        pool.num_free_blocks,
        pool.num_cached_blocks,
    )


def test_uncached_blocks_are_handed_out_most_recently_freed_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free_blocks == 2
    pool.free([1, 0])
    # Free stack now 3, 2, 1, 0 (0 on top): the blocks just freed go out again first.
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_a_freeing_and_allocating_workload_touches_only_its_working_set():
    pool = BlockPool(num_blocks=1000, block_size=16)
    touched: set[int] = set()
    for _ in range(200):
        block_ids = pool.allocate(5)
        touched.update(block_ids)
        pool.free(block_ids[::-1])
    assert touched == set(range(5))
    pool.check_integrity()


def test_ref_counts_and_sharing_of_cached_blocks():
    pool = BlockPool(num_blocks=3, block_size=2)
    [block] = pool.allocate(1)
    block_hash = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(block, block_hash)
    assert pool.lookup(block_hash) == block
    pool.share([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 2
    pool.free([block])
    # Free but still cached: reusable until evicted.
    assert pool.ref_count(block) == 0 and pool.lookup(block_hash) == block
    pool.share([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 2
    pool.check_integrity()


def test_cached_blocks_are_evicted_last_least_recently_freed_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    first, second, third, fourth = pool.allocate(4)
    hash_first = hash_block_tokens(None, [1, 2])
    hash_second = hash_block_tokens(hash_first, [3, 4])
    pool.cache_block(first, hash_first)
    pool.cache_block(second, hash_second)
    pool.free([second, first, third, fourth])
    # The uncached blocks go first (most recently freed first); the prefix stays cached.
    assert pool.allocate(2) == [fourth, third]
    assert pool.lookup(hash_first) == first and pool.lookup(hash_second) == second
    # Then the cached ones, in the order they were freed, each losing its hash.
    assert pool.allocate(1) == [second]
    assert pool.lookup(hash_second) is None and pool.block_hash(second) is None
    assert pool.lookup(hash_first) == first
    assert pool.allocate(1) == [first]
    assert pool.lookup(hash_first) is None and pool.block_hash(first) is None
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


def test_a_second_block_with_the_same_prefix_is_not_cached():
    pool = BlockPool(num_blocks=2, block_size=2)
    first, second = pool.allocate(2)
    block_hash = hash_block_tokens(None, [5, 6])
    assert pool.cache_block(first, block_hash)
    assert not pool.cache_block(second, block_hash)
    assert pool.block_hash(second) is None and pool.lookup(block_hash) == first
    assert pool.cache_block(first, block_hash)  # idempotent
    pool.check_integrity()


def test_chained_hash_depends_on_the_parent_and_the_tokens():
    root = hash_block_tokens(None, [1, 2])
    assert root == hash_block_tokens(None, [1, 2])
    assert root != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(root, [3, 4]) != hash_block_tokens(None, [3, 4])
    other_root = hash_block_tokens(None, [9, 9])
    assert hash_block_tokens(root, [3, 4]) != hash_block_tokens(other_root, [3, 4])


@pytest.mark.parametrize(
    "misuse, error",
    [
        (lambda pool: pool.free([0]), DoubleFreeError),  # block 0 is free
        (lambda pool: pool.free([1, 1]), DoubleFreeError),  # ref count 1, freed twice
        (lambda pool: pool.free([1, 7]), UnknownBlockError),  # 7 is out of range
        (lambda pool: pool.free([-1]), UnknownBlockError),
        (lambda pool: pool.share([1]), BlockStateError),  # in use but not cached
        (lambda pool: pool.share([2, 0]), BlockStateError),  # 2 is cached, 0 is free
        (lambda pool: pool.allocate(3), OutOfBlocksError),
        (lambda pool: pool.allocate(-1), ValueError),
        (lambda pool: pool.cache_block(0, b"x"), BlockStateError),  # free
        (lambda pool: pool.cache_block(2, b"other"), BlockStateError),  # already cached
        (lambda pool: pool.ref_count(4), UnknownBlockError),
    ],
)
def test_misuse_raises_a_typed_error_and_changes_nothing(misuse, error):
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate(3)  # 0, 1, 2
    pool.cache_block(2, hash_block_tokens(None, [1, 1]))
    pool.free([0])
    before = snapshot(pool)
    with pytest.raises(error):
        misuse(pool)
    assert snapshot(pool) == before
    pool.check_integrity()


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)


def test_check_integrity_catches_a_broken_invariant():
    pool = BlockPool(num_blocks=2, block_size=2)
    pool.allocate(1)
    pool._ref_counts[0] = 0  # a block with no references outside the free lists
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_a_cached_block_on_the_free_stack():
    pool = BlockPool(num_blocks=2, block_size=2)
    [block] = pool.allocate(1)
    pool.cache_block(block, hash_block_tokens(None, [1, 2]))
    pool.free([block])
    pool._free_cached.pop(block)
    pool._free_stack.append(block)
    with pytest.raises(AssertionError, match="wrong free list"):
        pool.check_integrity()
