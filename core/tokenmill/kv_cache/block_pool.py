"""The physical KV blocks, their free queue, and the prefix-cache hash map.

A block is *referenced* (``ref_cnt > 0``) while some request uses it, and
*free* otherwise; every free block sits in the free queue, every referenced
one is out of it. A free block may still hold a hash: its KV stays valid and
can be hit by a later request until the block is popped for new content.

The free queue is therefore also the eviction order: unhashed blocks sit at
the front (nothing is lost by reusing them), hashed ones at the back in
least-recently-used order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tokenmill.request import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """One block of KV slots. Identity matters, so equality is ``is``."""

    block_id: int
    ref_cnt: int = 0
    # Set only while this block is the one the hash map holds for that hash.
    block_hash: BlockHash | None = None
    # Free-queue links; both are None exactly when the block is out of the queue.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """A doubly linked list of blocks with O(1) removal from the middle.

    A ``deque`` cannot remove an arbitrary element in O(1), and a prefix hit
    must pull a cached block out of the middle of the queue. Two sentinels
    keep every real block's links non-None while it is queued.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front (next to be popped) to back."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        """Take the front block; ``IndexError`` if the queue is empty."""
        if self._len == 0:
            raise IndexError("popleft from an empty FreeBlockQueue")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (popped last)."""
        assert self._tail.prev_free is not None
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front (popped next)."""
        self._link_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is; ``ValueError`` if not queued."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.in_free_queue:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1


class BlockPool:
    """Owns every block, the free queue and the ``BlockHash -> block`` map.

    All ``num_blocks`` blocks are usable; none is reserved.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` free blocks, each with ``ref_cnt`` 1.

        Popping a block that still held a hash evicts it from the cache: its
        slots are about to be overwritten. Raises ``ValueError`` (and takes
        nothing) if fewer blocks are free.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot get a negative number of blocks ({num_blocks})")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0, f"block {block.block_id} was free with ref_cnt {block.ref_cnt}"
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop ``block`` from the hash map, if it is there."""
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding the KV of ``block_hash``, if it is still cached."""
        if not self.enable_caching:
            return None
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a prefix-cache hit).

        A hit on a freed-but-cached block revives it: it leaves the free
        queue so it cannot be evicted while in use.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block, in the order they should be evicted.

        Blocks left unreferenced go back to the free queue: unhashed ones to
        the front (reused first, nothing lost), hashed ones to the back, so
        cached blocks are evicted least-recently-freed first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` in the hash map.

        ``block_hashes[i]`` is the hash of ``blocks[i]``'s content, which must
        be fully written. If another block already holds that hash (two
        requests computed the same prefix at once), the existing mapping
        stays and this block remains unhashed: a duplicate is worth nothing
        to the cache, so when freed it is reused first.
        """
        if not self.enable_caching:
            return
        for index in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[index], block_hashes[index]
            if block.block_hash is not None:
                # Already published (e.g. it came from a prefix hit).
                assert block.block_hash == block_hash, f"block {block.block_id} rehashed with other content"
                continue
            if block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (``False``) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True
