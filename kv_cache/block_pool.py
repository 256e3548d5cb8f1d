"""Ref-counted KV-cache blocks, two free lists, and the prefix-cache map.

A block is one of three things at any time:

    in use          ref_count > 0, on no free list (may be cached: full and immutable)
    free, cached    ref_count == 0, in the cached free queue, still mapped by its hash: reusable
    free            ref_count == 0, on the free stack, no hash

``allocate`` pops the free stack first (most recently freed first: a small working set of blocks
stays hot while the rest of the cache sits idle), and only when it is empty evicts cached blocks
from the head of the cached free queue (least recently freed first), dropping their hash. ``free``
pushes blocks whose count drops to 0 onto the stack, or appends them to the queue's tail when they
are cached. A cached prefix is thus evicted only when no uncached block is free:

    free stack [5, 3] (3 on top), cached queue [0, 1]:   allocate(3) -> [3, 5, 0], hash of 0 gone

A cached block is only ever full: its tokens never change, so any number of requests may share it.

Every method validates all of its block ids before it changes anything and raises a typed error
(``kv_cache.errors``) on misuse.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from kv_cache.errors import (
    BlockStateError,
    DoubleFreeError,
    OutOfBlocksError,
    UnknownBlockError,
)

BlockHash = bytes


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], generated_from: int | None = None
) -> BlockHash:
    """The chained hash of one full block: sha256(parent's hash + this block's token ids, and
    ``generated_from``, the first of them a request generated, where given).

    Chaining makes a block's hash stand for the whole prefix up to and including it. sha256 (not
    Python's ``hash``) so that one client cannot craft a collision with another's prompt.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    if generated_from is not None:  # (a length no block of tokens alone has)
        digest.update(b"g" + array("q", [generated_from]).tobytes())
    return digest.digest()


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots each, ids ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        # Free blocks without a hash; the top (end) is popped first, so block 0 goes first.
        self._free_stack: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free cached blocks; insertion order is LRU order: the head is evicted first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not: all of them can be allocated now."""
        return len(self._free_stack) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        self._check_ids((block_id,))
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        self._check_ids((block_id,))
        return self._hashes[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The cached block holding the prefix ``block_hash`` stands for, if any."""
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (ref count 1): from the top of the free stack, then from the
        head of the cached free queue, evicting their hashes."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(
                f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free"
            )
        block_ids = []
        for _ in range(num_blocks):
            if self._free_stack:
                block_id = self._free_stack.pop()
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                block_hash = self._hashes[block_id]
                assert block_hash is not None
                del self._cached[block_hash]
                self._hashes[block_id] = None
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each cached block (a prefix-cache hit); a free one leaves the cached
        free queue."""
        self._check_ids(block_ids)
        for block_id in block_ids:
            block_hash = self._hashes[block_id]
            if block_hash is None or self._cached.get(block_hash) != block_id:
                raise BlockStateError(f"block {block_id} is not in the prefix cache")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_cached[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per listed id; blocks reaching 0 are pushed onto the free stack or,
        when cached, join the tail of the cached free queue, in the order given (so list a
        request's blocks last-first to keep its prefix longest)."""
        self._check_ids(block_ids)
        for block_id, count in Counter(block_ids).items():
            if count > self._ref_counts[block_id]:
                raise DoubleFreeError(
                    f"block {block_id} freed {count} time(s) with ref count "
                    f"{self._ref_counts[block_id]}"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hashes[block_id] is None:
                    self._free_stack.append(block_id)
                else:
                    self._free_cached[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, computed block under ``block_hash``. Returns False (and leaves the block
        uncached) when another block already holds that prefix."""
        self._check_ids((block_id,))
        if self._ref_counts[block_id] == 0:
            raise BlockStateError(f"block {block_id} is free and cannot be cached")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise BlockStateError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant does not hold (for tests and idle checks)."""
        assert len(self._ref_counts) == len(self._hashes) == self.num_blocks
        assert all(count >= 0 for count in self._ref_counts), "negative ref count"
        free_ids = set(self._free_stack) | set(self._free_cached)
        assert len(free_ids) == self.num_free_blocks, "a block is free twice"
        for block_id in range(self.num_blocks):
            is_free = block_id in free_ids
            assert is_free == (self._ref_counts[block_id] == 0), (
                f"block {block_id}: ref count {self._ref_counts[block_id]}, free: {is_free}"
            )
            block_hash = self._hashes[block_id]
            if is_free:
                assert (block_id in self._free_cached) == (block_hash is not None), (
                    f"block {block_id} is on the wrong free list"
                )
            if block_hash is not None:
                assert self._cached.get(block_hash) == block_id, f"block {block_id}: stale hash"
        for block_hash, block_id in self._cached.items():
            assert 0 <= block_id < self.num_blocks
            assert self._hashes[block_id] == block_hash, f"hash map points at block {block_id}"

    def _check_ids(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
                raise UnknownBlockError(f"block id {block_id!r} is not in 0..{self.num_blocks - 1}")
