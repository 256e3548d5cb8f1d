"""Blocked KV-cache bookkeeping: a ref-counted block pool with a prefix cache, and per-request
block tables. Pure Python: block ids and counts, no tensors."""

from kv_cache.block_pool import BlockHash, BlockPool, hash_block_tokens
from kv_cache.errors import (
    BlockStateError,
    DoubleFreeError,
    KVCacheError,
    OutOfBlocksError,
    RequestStateError,
    UnknownBlockError,
)
from kv_cache.manager import KVCacheManager

__all__ = [
    "BlockHash",
    "BlockPool",
    "BlockStateError",
    "DoubleFreeError",
    "KVCacheError",
    "KVCacheManager",
    "OutOfBlocksError",
    "RequestStateError",
    "UnknownBlockError",
    "hash_block_tokens",
]
