"""Paged KV cache bookkeeping: block hashing, the block pool, the manager."""

from tokenmill.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tokenmill.kv_cache.hashing import (
    block_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from tokenmill.kv_cache.manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
    "block_extra_keys",
    "hash_block_tokens",
    "update_block_hashes",
]
