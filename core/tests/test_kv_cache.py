"""Tests of the paged KV cache: hashing, the block pool, the manager.

The state machine at the bottom drives the manager the way a scheduler does
(prefix lookup, chunked prefill, decode, preemption, finish) over prompts
drawn from a two-token alphabet, so prefixes are shared and blocks get hit,
evicted and reused all the time, and checks the pool's invariants after
every step. It also tracks what each block's KV really holds, to prove that
a hit never serves the KV of other content.
"""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import count

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.kv_cache import (
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheBlocks,
    KVCacheManager,
    block_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from tokenmill.request import BlockHash, Request, RequestId
from tokenmill.sampling_params import SamplingParams

_ids = count()


def make_request(tokens: list[int], **kwargs) -> Request:
    prompt_logprobs = kwargs.pop("prompt_logprobs", None)
    return Request(
        request_id=RequestId(f"req-{next(_ids)}"),
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs),
        **kwargs,
    )


def run_prefill(manager: KVCacheManager, request: Request) -> KVCacheBlocks | None:
    """Schedule the whole prompt at once, as a scheduler would, and cache it."""
    hit, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hit, num_hit)
    if new is None:
        return None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return new


# --------------------------------------------------------------------------- hashing


def test_hash_is_deterministic_and_chained() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4], None)
    assert isinstance(h1, bytes) and len(h1) == 32
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5], None)
    h2 = hash_block_tokens(h1, [5, 6, 7, 8], None)
    assert h2 != hash_block_tokens(None, [5, 6, 7, 8], None)
    assert h2 != hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4], None), [5, 6, 7, 8], None)
    assert hash_block_tokens(None, [1], (("lora", "a"),)) != hash_block_tokens(None, [1], None)
    assert hash_block_tokens(None, [1], (("lora", "a"),)) != hash_block_tokens(None, [1], (("salt", "a"),))


def test_hash_does_not_run_fields_together() -> None:
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1], (2, "a"))
    assert hash_block_tokens(None, [], ("ab",)) != hash_block_tokens(None, [], ("a", "b"))


def test_hash_rejects_unstable_extra_keys() -> None:
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (object(),))


def test_hash_is_stable_across_processes() -> None:
    code = (
        "from tokenmill.kv_cache import hash_block_tokens as h;"
        "p = h(None, [1, 2, 3], (('lora', 'x'), ('salt', 's')));"
        "print(h(p, [4, 5, 6], (('mm', 'img'),)).hex())"
    )
    expected = hash_block_tokens(
        hash_block_tokens(None, [1, 2, 3], (("lora", "x"), ("salt", "s"))), [4, 5, 6], (("mm", "img"),)
    ).hex()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


def test_block_extra_keys() -> None:
    plain = make_request(list(range(12)))
    assert block_extra_keys(plain, 0, 4) is None
    req = make_request(list(range(12)), lora_name="ad", cache_salt="s", mm_hashes=[(2, 3, "img1"), (8, 1, "img2")])
    assert block_extra_keys(req, 0, 4) == (("lora", "ad"), ("mm", "img1"), ("salt", "s"))
    assert block_extra_keys(req, 4, 8) == (("lora", "ad"), ("mm", "img1"))  # img1 covers 2..4
    assert block_extra_keys(req, 8, 12) == (("lora", "ad"), ("mm", "img2"))
    salted = make_request(list(range(12)), cache_salt="s")
    assert block_extra_keys(salted, 4, 8) is None
    mm = make_request(list(range(12)), mm_hashes=[(4, 4, "img")])
    assert block_extra_keys(mm, 0, 4) is None and block_extra_keys(mm, 8, 12) is None
    assert block_extra_keys(mm, 4, 8) == (("mm", "img"),)


def _hashes_from_scratch(request: Request, block_size: int) -> list[BlockHash]:
    tokens, parent, out = request.all_token_ids, None, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(
            parent, tokens[start:start + block_size], block_extra_keys(request, start, start + block_size)
        )
        out.append(parent)
    return out


def test_update_block_hashes_is_incremental() -> None:
    req = make_request([1, 2, 3, 4, 5, 6], cache_salt="x")
    update_block_hashes(req, 4)
    assert len(req.block_hashes) == 1
    first = req.block_hashes[0]
    for token in [7, 8, 9, 10, 11]:
        req.append_output_token(token)
        update_block_hashes(req, 4)
        assert req.block_hashes == _hashes_from_scratch(req, 4)
    assert len(req.block_hashes) == 2 and req.block_hashes[0] is first
    # Only new blocks are hashed: a tampered old hash is kept, and chained from.
    req.block_hashes[1] = BlockHash(b"tampered")
    req.append_output_token(12)
    update_block_hashes(req, 4)
    assert req.block_hashes[2] == hash_block_tokens(BlockHash(b"tampered"), [9, 10, 11, 12], None)


# --------------------------------------------------------------------------- free queue and pool


def test_free_block_queue_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5 and [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert not blocks[2].in_free_queue
    with pytest.raises(ValueError):
        queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    queue.appendleft(blocks[2])
    queue.append(blocks[0])
    with pytest.raises(ValueError):
        queue.append(blocks[0])
    assert [b.block_id for b in queue] == [2, 1, 3, 4, 0] and len(queue) == 5
    for _ in range(5):
        queue.popleft()
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()


def test_pool_allocates_every_block_and_refuses_overdraw() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks) and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(ValueError):
        pool.free_blocks(blocks[:1])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0


def _hash(i: int) -> BlockHash:
    return hash_block_tokens(None, [i], None)


def test_unhashed_blocks_are_reused_before_hashed_ones() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)], 0, 2)
    pool.free_blocks(blocks)  # 0 and 1 hashed, 2 and 3 not
    reused = {b.block_id for b in pool.get_new_blocks(2)}
    assert reused == {2, 3}
    assert pool.get_cached_block(_hash(0)) is blocks[0]
    assert pool.get_cached_block(_hash(1)) is blocks[1]


def test_hashed_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1), _hash(2)], 0, 3)
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[2]])
    pool.touch([blocks[0]])  # a hit revives block 0...
    assert blocks[0].ref_cnt == 1 and not blocks[0].in_free_queue
    pool.free_blocks([blocks[0]])  # ...and freeing it again makes it the most recent
    (first,) = pool.get_new_blocks(1)
    assert first is blocks[1]
    assert pool.get_cached_block(_hash(1)) is None and first.block_hash is None
    (second,) = pool.get_new_blocks(1)
    assert second is blocks[2]
    assert pool.get_cached_block(_hash(0)) is blocks[0]


def test_cache_full_blocks_keeps_existing_mapping() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [_hash(7)], 0, 1)
    pool.cache_full_blocks([b], [_hash(7)], 0, 1)
    assert pool.get_cached_block(_hash(7)) is a and b.block_hash is None


def test_pool_without_caching_caches_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)], 0, 2)
    assert pool.get_cached_block(_hash(0)) is None and not pool.cached_blocks


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [_hash(0), _hash(1)], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(_hash(0)) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(_hash(0)) is None and all(b.block_hash is None for b in blocks)


# --------------------------------------------------------------------------- manager


def test_prefix_hit_is_shared_and_last_token_always_computed() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request(list(range(10)))
    assert run_prefill(manager, first) is not None
    assert len(manager.get_block_ids(first.request_id)) == 3

    second = make_request([*range(10), 99])
    hit, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8 and hit.get_block_ids() == manager.get_block_ids(first.request_id)[:2]
    new = manager.allocate_slots(second, second.num_tokens - num_hit, hit, num_hit)
    assert new is not None and len(new.blocks) == 1
    assert all(b.ref_cnt == 2 for b in hit.blocks)
    assert manager.get_block_ids(second.request_id)[:2] == hit.get_block_ids()

    # A prompt of exactly two full blocks hits only one: the last token is recomputed.
    exact = make_request(list(range(8)))
    _, num_hit = manager.get_computed_blocks(exact)
    assert num_hit == 4
    stats = manager.take_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (3, 10 + 11 + 8, 0 + 8 + 4)
    assert manager.prefix_cache_stats.queries == 0


def test_no_hit_without_caching_or_with_prompt_logprobs() -> None:
    for manager in (KVCacheManager(10, 4, enable_caching=False), KVCacheManager(10, 4)):
        run_prefill(manager, make_request(list(range(9))))
        req = make_request(list(range(9)), prompt_logprobs=None if not manager.enable_caching else 1)
        hit, num_hit = manager.get_computed_blocks(req)
        assert hit.blocks == [] and num_hit == 0


@pytest.mark.parametrize("key", ["cache_salt", "lora_name"])
def test_salt_and_lora_isolate_identical_prompts(key: str) -> None:
    manager = KVCacheManager(num_blocks=20, block_size=4)
    tokens = list(range(13))
    run_prefill(manager, make_request(tokens, **{key: "a"}))
    assert manager.get_computed_blocks(make_request(tokens, **{key: "b"}))[1] == 0
    assert manager.get_computed_blocks(make_request(tokens))[1] == 0
    assert manager.get_computed_blocks(make_request(tokens, **{key: "a"}))[1] == 12


def test_multimodal_hash_isolates_identical_placeholders() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=4)
    tokens = [0] * 13
    run_prefill(manager, make_request(tokens, mm_hashes=[(5, 2, "cat")]))
    assert manager.get_computed_blocks(make_request(tokens, mm_hashes=[(5, 2, "dog")]))[1] == 4
    assert manager.get_computed_blocks(make_request(tokens, mm_hashes=[(5, 2, "cat")]))[1] == 12


def test_failed_allocation_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    first = make_request(list(range(12)))
    run_prefill(manager, first)
    manager.free(first)  # three cached blocks, all free
    big = make_request(list(range(12)) + list(range(100, 110)))  # 22 tokens: 6 blocks
    hit, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 12
    before = [(b.ref_cnt, b.block_hash, b.in_free_queue) for b in manager.block_pool.blocks]
    # The 3 revived hit blocks plus 3 new ones need 6 of the 4 free blocks.
    assert manager.allocate_slots(big, big.num_tokens - num_hit, hit, num_hit) is None
    assert [(b.ref_cnt, b.block_hash, b.in_free_queue) for b in manager.block_pool.blocks] == before
    assert manager.get_block_ids(big.request_id) == [] and manager.num_free_blocks == 4


def test_allocate_grows_by_blocks_and_free_is_idempotent() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request([1, 2, 3])
    new = manager.allocate_slots(req, 3)
    assert new is not None and len(new.blocks) == 1
    req.num_computed_tokens = 3
    assert manager.allocate_slots(req, 1).blocks == []  # token 4 still fits
    req.num_computed_tokens = 4
    assert len(manager.allocate_slots(req, 5).blocks) == 2
    assert len(manager.get_block_ids(req.request_id)) == 3
    manager.free(req)
    manager.free(req)
    manager.free(make_request([1]))
    assert manager.num_free_blocks == 8 and manager.usage == 0.0


def test_free_evicts_tail_before_head() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    req = make_request([1, 2, 3, 4, 5, 6, 7])
    run_prefill(manager, req)
    ids = manager.get_block_ids(req.request_id)
    manager.free(req)
    assert manager.get_blocks(req.request_id).blocks == [] and manager.num_free_blocks == 4
    # The partial last block is unhashed, so reused first; then the tail, then the head.
    order = [manager.block_pool.get_new_blocks(1)[0].block_id for _ in range(4)]
    assert order == ids[::-1]


def test_stale_hit_is_refused() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=2)
    first = make_request([1, 2, 3])
    run_prefill(manager, first)
    manager.free(first)
    again = make_request([1, 2, 3])
    hit, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 2
    manager.block_pool.get_new_blocks(2)  # someone else evicts the hit in between
    with pytest.raises(ValueError):
        manager.allocate_slots(again, 1, hit, num_hit)


def test_reset_prefix_cache() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    req = make_request([1, 2, 3, 4, 5])
    run_prefill(manager, req)
    assert manager.reset_prefix_cache() is False
    manager.free(req)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request([1, 2, 3, 4, 5]))[1] == 0


def test_kv_cache_blocks_result() -> None:
    a, b = KVCacheBlock(3), KVCacheBlock(5)
    assert KVCacheBlocks([a, b]).get_block_ids() == [3, 5]
    assert KVCacheBlocks.empty().get_block_ids() == []
    assert KVCacheBlocks.empty() is not None and bool(KVCacheBlocks.empty())


# --------------------------------------------------------------------------- state machine

BLOCK_SIZE = 4
NUM_BLOCKS = 8
MAX_DRAFTS = 5  # draft tokens a speculative step carries at most
Content = tuple  # (salt, tokens of the whole prefix up to this block's end)


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a ``KVCacheManager`` like a scheduler and checks its invariants."""

    CACHING = True

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=self.CACHING)
        self.running: list[Request] = []
        self.prompts: list[list[int]] = []
        # What each block's KV really holds (None: garbage or a partial block).
        self.content: dict[int, Content | None] = {}
        # What each hash stands for; a cached block must hold exactly that.
        self.hash_meaning: dict[BlockHash, Content] = {}

    # ----------------------------------------------------------------- helpers

    def _prefix(self, request: Request, num_blocks: int) -> Content:
        return (request.cache_salt, tuple(request.all_token_ids[: num_blocks * BLOCK_SIZE]))

    def _snapshot(self) -> tuple:
        pool = self.manager.block_pool
        return (
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            dict(pool.cached_blocks),
            {r.request_id: self.manager.get_block_ids(r.request_id) for r in self.running},
            dict(self.manager._num_cached_blocks),
        )

    def _allocate(self, request: Request, num_new: int, hit: KVCacheBlocks | None = None, num_hit: int = 0) -> bool:
        before = self._snapshot()
        new = self.manager.allocate_slots(request, num_new, hit, num_hit)
        if new is None:
            assert self._snapshot() == before, "a failed allocate_slots changed state"
            return False
        for block in new.blocks:
            assert block.ref_cnt == 1 and block.block_hash is None
            self.content[block.block_id] = None
        return True

    def _execute(self, request: Request, num_new: int) -> None:
        """The model ran: ``num_new`` more tokens have KV; record and cache it."""
        request.num_computed_tokens += num_new
        blocks = self.manager.get_blocks(request.request_id).blocks
        for index in range(request.num_computed_tokens // BLOCK_SIZE):
            self.content[blocks[index].block_id] = self._prefix(request, index + 1)
        self.manager.cache_blocks(request, request.num_computed_tokens)
        for index, block_hash in enumerate(request.block_hashes):
            meaning = self._prefix(request, index + 1)
            assert self.hash_meaning.setdefault(block_hash, meaning) == meaning

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        request.num_computed_tokens = 0

    # ----------------------------------------------------------------- rules

    @rule(
        tokens=st.lists(st.integers(0, 1), max_size=6 * BLOCK_SIZE),
        base=st.integers(0, 100),
        keep=st.integers(0, 6 * BLOCK_SIZE),
        salt=st.sampled_from([None, None, "s"]),
        chunk=st.integers(1, 6 * BLOCK_SIZE),
    )
    def add_request(self, tokens: list[int], base: int, keep: int, salt: str | None, chunk: int) -> None:
        """A new prompt: random tokens after a prefix of an earlier prompt."""
        if self.prompts:
            tokens = self.prompts[base % len(self.prompts)][:keep] + tokens
        if not tokens:
            return
        self.prompts.append(tokens)
        request = make_request(tokens, cache_salt=salt)
        hit, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit == len(hit.blocks) * BLOCK_SIZE
        assert len(hit.blocks) <= (request.num_tokens - 1) // BLOCK_SIZE
        if not self.CACHING:
            assert num_hit == 0
        for index, block in enumerate(hit.blocks):
            # The heart of prefix caching: a hit serves exactly this prefix's KV.
            assert self.content[block.block_id] == self._prefix(request, index + 1)
        num_new = min(chunk, request.num_tokens - num_hit)
        if not self._allocate(request, num_new, hit, num_hit):
            self.manager.free(request)  # never scheduled: holds nothing, must be a no-op
            return
        request.num_computed_tokens = num_hit
        self.running.append(request)
        self._execute(request, num_new)

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100), chunk=st.integers(1, 2 * BLOCK_SIZE), token=st.integers(0, 1))
    def step(self, which: int, chunk: int, token: int) -> None:
        request = self.running[which % len(self.running)]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)  # sampled at the end of the last step
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self._allocate(request, num_new):
            self._execute(request, num_new)
        else:
            self._preempt(request)

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100), drafts=st.lists(st.integers(0, 1), min_size=1, max_size=MAX_DRAFTS),
          accepted=st.integers(0, MAX_DRAFTS), token=st.integers(0, 1))
    def speculative_step(self, which: int, drafts: list[int], accepted: int, token: int) -> None:
        """A decode with draft tokens: slots for all of them; the target accepts the first
        ``accepted`` (and samples one more), the rest are taken back and must never be cached."""
        request = self.running[which % len(self.running)]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)
        if request.num_tokens - request.num_computed_tokens != 1:  # still prefilling
            return
        if not self._allocate(request, 1 + len(drafts)):
            self._preempt(request)
            return
        # What the forward wrote: the last token's KV, then the drafts'.
        written = request.all_token_ids + drafts
        blocks = self.manager.get_blocks(request.request_id).blocks
        for index in range(request.num_computed_tokens // BLOCK_SIZE, len(written) // BLOCK_SIZE):
            self.content[blocks[index].block_id] = (request.cache_salt, tuple(written[: (index + 1) * BLOCK_SIZE]))
        accepted = min(accepted, len(drafts))
        for draft in drafts[:accepted]:
            request.append_output_token(draft)
        request.append_output_token(1 - drafts[accepted] if accepted < len(drafts) else token)
        request.num_computed_tokens += 1 + accepted  # the scheduler takes the rejected ones back
        self.manager.cache_blocks(request, request.num_computed_tokens)
        held = self.manager.get_blocks(request.request_id).blocks
        free_before = self.manager.num_free_blocks
        freed = self.manager.free_excess(request, request.num_tokens)  # and gives their slots back
        assert freed == max(0, len(held) - -(-request.num_tokens // BLOCK_SIZE))
        assert self.manager.num_free_blocks == free_before + freed
        assert all(b.block_hash is None for b in held[len(held) - freed:]), "a rejected draft's block was cached"
        for index, block_hash in enumerate(request.block_hashes):
            meaning = self._prefix(request, index + 1)
            assert self.hash_meaning.setdefault(block_hash, meaning) == meaning

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def finish(self, which: int) -> None:
        request = self.running.pop(which % len(self.running))
        self.manager.free(request)
        self.manager.free(request)  # a second free is harmless

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = not any(self.manager.get_block_ids(r.request_id) for r in self.running)
        assert self.manager.reset_prefix_cache() is idle
        if idle:
            assert not self.manager.block_pool.cached_blocks

    # ----------------------------------------------------------------- invariants

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        pool = self.manager.block_pool
        queued = list(pool.free_queue)
        assert len(queued) == len(pool.free_queue) == self.manager.num_free_blocks
        assert len({id(b) for b in queued}) == len(queued)
        referenced = [b for b in pool.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        assert len(queued) + len(referenced) == NUM_BLOCKS
        assert all(b.ref_cnt == 0 and b.in_free_queue for b in queued)
        assert not any(b.in_free_queue for b in referenced)
        assert self.manager.usage == pytest.approx(len(referenced) / NUM_BLOCKS)

    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders: dict[int, int] = {}
        for request in self.running:
            ids = self.manager.get_block_ids(request.request_id)
            assert len(set(ids)) == len(ids), "a request holds a block twice"
            assert len(ids) * BLOCK_SIZE >= request.num_computed_tokens
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.manager.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)

    @invariant()
    def no_request_holds_more_than_its_tokens_need(self) -> None:
        """The slots of rejected drafts go back to the pool right after the step that rejected
        them: between steps a request holds no block beyond its tokens (no leak with drafts)."""
        for request in self.running:
            limit = -(-request.num_tokens // BLOCK_SIZE)
            assert len(self.manager.get_block_ids(request.request_id)) <= limit

    @invariant()
    def hash_map_is_truthful(self) -> None:
        pool = self.manager.block_pool
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
            assert self.content[block.block_id] == self.hash_meaning[block_hash]
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached_blocks)
        if not self.CACHING:
            assert not pool.cached_blocks


class KVCacheNoCachingMachine(KVCacheMachine):
    CACHING = False


_machine_settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = _machine_settings
TestKVCacheNoCachingMachine = KVCacheNoCachingMachine.TestCase
TestKVCacheNoCachingMachine.settings = settings(_machine_settings, max_examples=20)
