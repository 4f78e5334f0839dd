"""The attention kit's cases: small paged batches, built as the model runner builds them.

A case is a list of requests, each ``(cached tokens, new tokens)``, and the layer's
shape (heads, KV heads, head size), the cache's block size and optionally a sliding
window or a soft cap. :func:`build_paged_batch` turns it into what a backend sees in
one step: the metadata, the new tokens' query/key/value, and a KV cache whose blocks
are handed out in random order, holding the cached prefix of every request and
garbage everywhere else (a backend that reads a slot it should not, or forgets to mask
one, sees large values). A padded case widens the block table past what its longest
request needs and fills the unused entries with other requests' block ids, as a
persistent batch's stale rows hold. :func:`reference_attention` is the definition in
float64, per request, from the un-paged keys and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tokenmill.attention.metadata import AttentionMetadata

GARBAGE_SCALE = 100.0  # the cache slots nobody wrote hold values this large


@dataclass(frozen=True)
class AttentionCase:
    """One step of a paged batch. ``requests``: ``(cached, new)`` token counts per request."""

    name: str
    requests: tuple[tuple[int, int], ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 4
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    padded_block_table: bool = False  # unused block-table entries point at other requests' blocks
    spare_blocks: int = 4  # blocks no request owns (garbage in them)

    @property
    def num_tokens(self) -> int:
        return sum(new for _, new in self.requests)


# Small enough that a whole run of them takes well under a second on one CPU core.
DEFAULT_CASES: tuple[AttentionCase, ...] = (
    AttentionCase("prefill-only", ((0, 7), (0, 13), (0, 1))),
    AttentionCase("decode-only", ((9, 1), (3, 1), (16, 1), (0, 1))),
    AttentionCase("mixed", ((9, 1), (0, 13), (3, 1), (6, 20))),
    AttentionCase("chunked-cached-prefix", ((12, 5), (8, 9), (4, 4))),
    AttentionCase("sliding-window", ((9, 1), (0, 13), (6, 20), (14, 3)), sliding_window=5),
    AttentionCase("gqa-4-to-1", ((5, 1), (0, 9), (7, 6)), num_heads=8, num_kv_heads=2),
    AttentionCase("mqa", ((5, 1), (0, 9), (7, 6)), num_heads=4, num_kv_heads=1),
    AttentionCase("mha", ((5, 1), (0, 9), (7, 6)), num_heads=4, num_kv_heads=4),
    AttentionCase("block-size-16", ((20, 1), (0, 17), (33, 8)), block_size=16),
    AttentionCase("block-size-1", ((4, 1), (0, 5), (3, 3)), block_size=1),
    AttentionCase("padded-block-table", ((9, 1), (0, 6), (2, 1)), padded_block_table=True, spare_blocks=8),
    AttentionCase("logits-soft-cap", ((9, 1), (0, 13), (6, 5)), logits_soft_cap=2.0),
)

# ``--tokenmill-kit=full`` adds these: the defaults at the head sizes and block sizes real
# models and backends use (64, 128; 16, 32), which are larger and slower.
def full_cases() -> tuple[AttentionCase, ...]:
    wider = [replace(case, name=f"{case.name}-head-{head}", head_size=head)
             for case in DEFAULT_CASES for head in (64, 128)]
    blocks = [replace(case, name=f"{case.name}-block-{block}", block_size=block)
              for case in DEFAULT_CASES if case.block_size == 4 for block in (16, 32)]
    long = [AttentionCase("long-mixed", ((200, 1), (0, 150), (90, 40), (300, 1)), head_size=64, block_size=16)]
    return DEFAULT_CASES + tuple(wider) + tuple(blocks) + tuple(long)


@dataclass
class PagedBatch:
    """A case made concrete: what a backend's ``prepare``/``forward`` take, and the truth."""

    case: AttentionCase
    metadata: AttentionMetadata
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, H_kv, D] the new tokens'
    value: torch.Tensor
    key_cache: torch.Tensor  # [blocks, block_size, H_kv, D]
    value_cache: torch.Tensor
    sequence_keys: list[torch.Tensor] = field(default_factory=list)  # per request [seq, H_kv, D], cached + new
    sequence_values: list[torch.Tensor] = field(default_factory=list)

    def copy_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh copy of the KV cache as it was before the step (each backend writes its own)."""
        return self.key_cache.clone(), self.value_cache.clone()


def build_paged_batch(case: AttentionCase, device: torch.device | str, dtype: torch.dtype,
                      seed: int = 0) -> PagedBatch:
    """The case's step on ``device`` in ``dtype``, with random contents from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    block, kv_heads, head = case.block_size, case.num_kv_heads, case.head_size

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    owned = [math.ceil((cached + new) / block) for cached, new in case.requests]
    num_blocks = sum(owned) + case.spare_blocks
    order = rng.permutation(num_blocks).tolist()
    tables = [[order.pop() for _ in range(n)] for n in owned]
    key_cache = randn(num_blocks, block, kv_heads, head, scale=GARBAGE_SCALE)
    value_cache = randn(num_blocks, block, kv_heads, head, scale=GARBAGE_SCALE)

    sequence_keys, sequence_values, slots = [], [], []
    for blocks, (cached, new) in zip(tables, case.requests, strict=True):
        keys, values = randn(cached + new, kv_heads, head), randn(cached + new, kv_heads, head)
        for pos in range(cached):  # the prefix an earlier step wrote
            key_cache[blocks[pos // block], pos % block] = keys[pos]
            value_cache[blocks[pos // block], pos % block] = values[pos]
        slots += [blocks[pos // block] * block + pos % block for pos in range(cached, cached + new)]
        sequence_keys.append(keys)
        sequence_values.append(values)

    width = max(owned) + (3 if case.padded_block_table else 0)
    everyone = [b for blocks in tables for b in blocks]
    table = np.zeros((len(tables), width), dtype=np.int64)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = blocks
        if case.padded_block_table:  # stale entries: blocks of other requests
            others = [b for b in everyone if b not in blocks] or [0]
            table[row, len(blocks):] = rng.choice(others, width - len(blocks))

    query_lens = np.array([new for _, new in case.requests], dtype=np.int64)
    seq_lens = np.array([cached + new for cached, new in case.requests], dtype=np.int64)
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    dev = torch.device(device)
    metadata = AttentionMetadata(
        num_reqs=len(case.requests), num_actual_tokens=int(query_start[-1]), max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=block,
        query_start_loc=torch.from_numpy(query_start).to(dev), seq_lens=torch.from_numpy(seq_lens).to(dev),
        context_lens=torch.from_numpy(seq_lens - query_lens).to(dev), block_table=torch.from_numpy(table).to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens)
    query = randn(case.num_tokens, case.num_heads, head)
    new_keys = torch.cat([k[c:] for k, (c, _) in zip(sequence_keys, case.requests, strict=True)])
    new_values = torch.cat([v[c:] for v, (c, _) in zip(sequence_values, case.requests, strict=True)])
    return PagedBatch(case, metadata, query.to(dev), new_keys.to(dev), new_values.to(dev), key_cache.to(dev),
                      value_cache.to(dev), sequence_keys, sequence_values)


def reference_attention(batch: PagedBatch) -> torch.Tensor:
    """The output by the definition, in float64: each new query of each request attends
    causally to that request's keys (within the window; scores soft-capped), [T, H, D]."""
    case = batch.case
    scale = case.head_size ** -0.5
    groups = case.num_heads // case.num_kv_heads
    query = batch.query.detach().cpu().double()
    outputs, start = [], 0
    for (cached, new), keys, values in zip(case.requests, batch.sequence_keys, batch.sequence_values, strict=True):
        q = query[start: start + new].transpose(0, 1)  # [H, n, D]
        k = keys.double().repeat_interleave(groups, 1).transpose(0, 1)  # [H, S, D]
        v = values.double().repeat_interleave(groups, 1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        if case.logits_soft_cap is not None:
            scores = torch.tanh(scores / case.logits_soft_cap) * case.logits_soft_cap
        q_pos = torch.arange(cached, cached + new)[:, None]
        k_pos = torch.arange(cached + new)[None, :]
        allowed = k_pos <= q_pos
        if case.sliding_window is not None:
            allowed &= q_pos - k_pos < case.sliding_window
        outputs.append((scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(0, 1))
        start += new
    return torch.cat(outputs)
