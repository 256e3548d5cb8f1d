"""Per-request block tables over a ``BlockPool``, with prefix caching.

A request's block table maps its token positions to physical blocks, ``block_size`` per block:

    block_size = 4, 10 tokens:   positions 0-3 | 4-7 | 8-9 . .
                                 block_table = [7, 2, 5]   (5 has two free slots)

Blocks whose tokens' K/V are computed and which are full get a chained hash and enter the prefix
cache (``cache_blocks``). A later request with the same leading tokens starts from those blocks
(``get_computed_blocks`` then ``allocate_slots``) and computes only the rest. A request never
writes into a cached block: cached blocks are full, and new tokens go into blocks after them.

With ``generated_apart`` (an engine whose products run differently for prompt and generated
tokens: ``ModelRunner.prompt_tiles``) a block that holds generated tokens hashes where they start
too, so its K/V serve only a request whose tokens there are of the same kinds (the request
itself after a preemption), never a prompt that repeats them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kv_cache.block_pool import BlockHash, BlockPool, hash_block_tokens
from kv_cache.errors import RequestStateError


class Request(Protocol):
    """What the manager reads of a request (``scheduler.Request`` has it; kv_cache does not
    import the scheduler)."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class _RequestBlocks:
    """What the manager knows about one request."""

    __slots__ = ("block_ids", "block_hashes", "num_cached_blocks")

    def __init__(self) -> None:
        # A tuple so that a batch row can carry it as is; replaced (not mutated) on growth.
        self.block_ids: tuple[int, ...] = ()
        # Chained hashes of the request's full blocks, computed lazily, in block order.
        self.block_hashes: list[BlockHash] = []
        # Leading blocks of ``block_ids`` already registered in (or taken from) the prefix cache.
        self.num_cached_blocks = 0


class KVCacheManager:
    """Block tables for requests; all counts are integers, no KV tensors live here."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        generated_apart: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.generated_apart = generated_apart
        # Prompt tokens looked up in the prefix cache at each admission, and those found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1); free cached blocks count as free."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] when it holds no blocks)."""
        state = self._requests.get(request_id)
        return list(state.block_ids) if state is not None else []

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table as an immutable tuple (shared, not copied)."""
        state = self._requests.get(request_id)
        return state.block_ids if state is not None else ()

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks matching the request's leading tokens, and the number
        of tokens they hold. At least one token is always left to compute (it yields the logits
        to sample from), so a fully cached 32-token request with block_size 16 gets one block.
        Changes nothing but the request's memoized block hashes."""
        if not self.enable_prefix_caching:
            return [], 0
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        if state.block_ids:
            raise RequestStateError(f"request {request.request_id!r} already holds blocks")
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in self._block_hashes(request, state, max_blocks):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for K/V of positions up to ``num_computed_tokens + cached + num_new_tokens``
        and ``num_lookahead_tokens`` positions beyond (the K/V of tokens not sampled yet: a batch
        of several decode steps writes those of the tokens it samples on the way).

        ``new_computed_blocks`` (from ``get_computed_blocks``, on admission only) are shared and
        become the head of the block table. Returns the newly allocated block ids ([] when the
        table already has room), or None when they do not fit now: then nothing changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        if new_computed_blocks and state.block_ids:
            raise RequestStateError(
                f"request {request.request_id!r} already holds blocks; prefix blocks are given "
                "on admission only"
            )
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = num_computed + num_new_tokens
        if num_required > request.num_tokens:
            raise RequestStateError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, "
                f"asked for slots up to {num_required}"
            )
        num_new_blocks = (
            self.num_blocks_for(num_required + num_lookahead_tokens)
            - len(state.block_ids)
            - len(new_computed_blocks)
        )
        if num_new_blocks <= 0 and not new_computed_blocks:
            return []
        num_new_blocks = max(num_new_blocks, 0)
        # Cached blocks nobody holds count as free: sharing them uses free blocks too.
        num_evictable = sum(1 for b in new_computed_blocks if self.pool.ref_count(b) == 0)
        if num_new_blocks + num_evictable > self.pool.num_free_blocks:
            return None
        first_allocation = not state.block_ids
        self.pool.share(new_computed_blocks)
        new_block_ids = self.pool.allocate(num_new_blocks)
        state.block_ids += (*new_computed_blocks, *new_block_ids)
        state.num_cached_blocks = max(state.num_cached_blocks, len(new_computed_blocks))
        if first_allocation and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        return new_block_ids

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_computed_tokens`` tokens (their
        K/V are computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        state = self._requests.get(request.request_id)
        if state is None:
            return
        num_full_blocks = min(num_computed_tokens // self.block_size, len(state.block_ids))
        if num_full_blocks <= state.num_cached_blocks:
            return
        block_hashes = self._block_hashes(request, state, num_full_blocks)
        for index in range(state.num_cached_blocks, num_full_blocks):
            self.pool.cache_block(state.block_ids[index], block_hashes[index])
        state.num_cached_blocks = num_full_blocks

    def free(self, request: Request) -> None:
        """Release every block the request holds (none is fine), last block first so that the
        prefix stays cached longest."""
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.block_ids:
            self.pool.free(state.block_ids[::-1])

    def check_integrity(self) -> None:
        """Raise AssertionError when the pool's invariants or the tables' agreement with the
        pool's ref counts do not hold."""
        self.pool.check_integrity()
        ref_counts = [0] * self.num_blocks
        for request_id, state in self._requests.items():
            assert len(set(state.block_ids)) == len(state.block_ids), (
                f"request {request_id!r} holds a block twice"
            )
            assert state.num_cached_blocks <= len(state.block_ids)
            for block_id in state.block_ids:
                ref_counts[block_id] += 1
        for block_id, count in enumerate(ref_counts):
            assert self.pool.ref_count(block_id) == count, (
                f"block {block_id}: ref count {self.pool.ref_count(block_id)}, "
                f"held by {count} request(s)"
            )
            if count > 1:
                assert self.pool.block_hash(block_id) is not None, (
                    f"block {block_id} is shared but not cached"
                )

    def _block_hashes(
        self, request: Request, state: _RequestBlocks, num_blocks: int
    ) -> list[BlockHash]:
        """The request's chained block hashes for at least its first ``num_blocks`` full blocks."""
        block_hashes = state.block_hashes
        token_ids = request.token_ids
        size = self.block_size
        prompt_end = request.num_prompt_tokens if self.generated_apart else None
        while len(block_hashes) < num_blocks:
            index = len(block_hashes)
            parent = block_hashes[-1] if block_hashes else None
            generated_from = None
            if prompt_end is not None and prompt_end < (index + 1) * size:
                generated_from = max(prompt_end - index * size, 0)
            block_hashes.append(
                hash_block_tokens(
                    parent, token_ids[index * size : (index + 1) * size], generated_from
                )
            )
        return block_hashes
