"""The scheduler's view of the paged KV cache: per-request block tables.

The scheduler drives a request through three calls per step:

1. ``get_computed_blocks`` (first scheduling only): the prefix-cache hit;
2. ``allocate_slots``: take the hit and enough blocks for the tokens
   scheduled this step, or ``None`` if the pool cannot supply them;
3. ``cache_blocks`` (after the step ran): publish the blocks whose KV is now
   written, so later requests can hit them;
4. ``free_excess`` (after a step that verified drafts): give back the blocks
   that only held the slots of rejected draft tokens.

and ``free`` when the request finishes or is preempted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenmill.kv_cache.block_pool import BlockPool, KVCacheBlock
from tokenmill.kv_cache.hashing import update_block_hashes
from tokenmill.request import Request, RequestId


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler, kept opaque so the layout can change.

    Deliberately no ``__len__``: ``allocate_slots`` returns an empty
    ``KVCacheBlocks`` on success and ``None`` on failure, and ``if not
    result`` must not confuse the two.
    """

    blocks: list[KVCacheBlock] = field(default_factory=list)

    @classmethod
    def empty(cls) -> KVCacheBlocks:
        return cls([])

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``reset``, counted in tokens."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.queries = self.hits = self.requests = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to blocks of a :class:`BlockPool`, with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_blocks: dict[RequestId, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the hash map.
        self._num_cached_blocks: dict[RequestId, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest run of leading cached blocks, and the tokens they cover.

        At most ``(num_tokens - 1) // block_size`` blocks hit, so at least the
        last token is computed and the step yields logits to sample from.
        Takes no references: pass the result to ``allocate_slots`` right
        away, before allocating for anyone else, or the hit may be evicted.
        """
        if not self.enable_caching or request.needs_every_position:
            # Prompt logprobs need the logits of every prompt token, so a hit
            # would skip work we actually need.
            return KVCacheBlocks.empty(), 0
        update_block_hashes(request, self.block_size)
        max_hit_blocks = max(0, (request.num_tokens - 1) // self.block_size)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return KVCacheBlocks(hits), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens this step.

        ``new_computed_blocks`` / ``num_new_computed_tokens`` are the prefix
        hit from ``get_computed_blocks``; they are referenced and appended to
        the request's blocks first, so the allocation below cannot evict
        them. Returns the newly allocated blocks (maybe none), or ``None``,
        with nothing changed, if the pool is short.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError("token counts must be non-negative")
        hit = new_computed_blocks.blocks if new_computed_blocks is not None else []
        held = self._req_blocks.get(request.request_id, [])
        self._check_hit(request, held, hit)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_to_allocate = max(0, _cdiv(num_tokens, self.block_size) - len(held) - len(hit))
        # A hit on a free (ref 0) cached block takes it out of the free pool too.
        num_revived = sum(1 for block in hit if block.ref_cnt == 0)
        if num_to_allocate + num_revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(hit)
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
        if hit:  # _check_hit made sure the request held nothing before
            self._num_cached_blocks[request.request_id] = len(hit)
        blocks = self._req_blocks.setdefault(request.request_id, [])
        blocks.extend(hit)
        blocks.extend(new_blocks)
        return KVCacheBlocks(new_blocks)

    def _check_hit(self, request: Request, held: list[KVCacheBlock], hit: list[KVCacheBlock]) -> None:
        """Refuse a hit that cannot be what ``get_computed_blocks`` just returned."""
        if not hit:
            return
        if held:
            raise ValueError(f"request {request.request_id} already holds blocks; a prefix hit starts at block 0")
        for index, block in enumerate(hit):
            if index >= len(request.block_hashes) or block.block_hash != request.block_hashes[index]:
                raise ValueError(
                    f"prefix hit block {block.block_id} of request {request.request_id} was evicted "
                    "since get_computed_blocks; call allocate_slots right after it"
                )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks whose KV is fully written.

        Those are the first ``num_computed_tokens // block_size`` blocks.
        Call after each step with the request's new ``num_computed_tokens``.
        """
        if not self.enable_caching:
            return
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        if num_full <= num_cached:
            return
        update_block_hashes(request, self.block_size)
        num_full = min(num_full, len(request.block_hashes))
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
        self._num_cached_blocks[request.request_id] = num_full

    def free_excess(self, request: Request, num_tokens: int) -> int:
        """Give back the request's trailing blocks that hold no position below ``num_tokens``:
        the slots of draft tokens the target rejected, which would otherwise stay with the
        request until it finishes. Such blocks are never in the hash map (only blocks of
        verified tokens are cached). Returns how many blocks went back to the pool."""
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = max(_cdiv(num_tokens, self.block_size), self._num_cached_blocks.get(request.request_id, 0))
        excess = blocks[keep:]
        if not excess:
            return 0
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(excess))
        return len(excess)

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget it; a no-op if it holds none.

        Blocks are freed tail first, so among the request's cached blocks the
        tail is evicted before the head, which other requests are likelier
        to share.
        """
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: RequestId) -> list[int]:
        """The request's block table, in token order (empty if it holds none)."""
        return [block.block_id for block in self._req_blocks.get(request_id, [])]

    def get_blocks(self, request_id: RequestId) -> KVCacheBlocks:
        """The request's blocks, in token order (empty if it holds none)."""
        return KVCacheBlocks(list(self._req_blocks.get(request_id, [])))

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call, resetting the counters."""
        stats = replace(self.prefix_cache_stats)
        self.prefix_cache_stats.reset()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; ``False`` (nothing done) while any is in use."""
        return self.block_pool.reset_prefix_cache()
