"""Typed errors for misuse of the KV-cache bookkeeping. Raised before anything is changed.

"Does not fit now" is not an error: ``KVCacheManager.allocate_slots`` returns ``None`` for it.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class: the caller broke the block pool's or the manager's contract."""


class UnknownBlockError(KVCacheError, ValueError):
    """A block id outside ``0 .. num_blocks - 1``."""


class DoubleFreeError(KVCacheError):
    """A block freed more often than it was allocated or shared."""


class OutOfBlocksError(KVCacheError):
    """More blocks asked of the pool than it has free (check ``num_free_blocks`` first)."""


class BlockStateError(KVCacheError):
    """A block used in a way its state does not allow (sharing an uncached block, caching a free
    block, giving a cached block a second hash)."""


class RequestStateError(KVCacheError):
    """A request used in a way its block state does not allow (slots beyond its tokens, prefix
    blocks handed to a request that already holds blocks)."""
