"""A mixed batch of prefills, chunks and decodes over a paged KV cache, for checking a GPU
attention backend against the SDPA reference on the same inputs (the backends' ``gpu`` tests)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.layers import Attention

# (tokens already cached, new tokens): decodes, a chunk and whole prompts in one step
MIXED = [(9, 1), (0, 13), (3, 1), (6, 20), (0, 1), (11, 4)]
DECODES = [(9, 1), (30, 1), (3, 1), (0, 1)]


@dataclass
class PagedCase:
    metadata: AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor

    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh copy of the cache (each backend writes the new tokens into its own)."""
        return self.key_cache.clone(), self.value_cache.clone()


def paged_case(requests: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, head_size: int,
               dtype: torch.dtype, device: str, seed: int = 0) -> PagedCase:
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in requests) + 4
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_size, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables, new_keys, new_values, slots = [], [], [], []
    for context, new in requests:
        seq = context + new
        blocks = [free.pop() for _ in range(-(-seq // block_size))]
        tables.append(blocks)
        keys = torch.randn(seq, kv_heads, head_size, generator=generator).to(dtype)
        values = torch.randn(seq, kv_heads, head_size, generator=generator).to(dtype)
        for pos in range(context):
            key_cache[blocks[pos // block_size], pos % block_size] = keys[pos]
            value_cache[blocks[pos // block_size], pos % block_size] = values[pos]
        new_keys.append(keys[context:])
        new_values.append(values[context:])
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(context, seq)]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query_lens = np.array([n for _, n in requests])
    query_start = np.concatenate([[0], np.cumsum(query_lens)])
    seq_lens = np.array([c + n for c, n in requests])
    metadata = AttentionMetadata(
        num_reqs=len(requests), num_actual_tokens=int(query_start[-1]), max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=block_size,
        query_start_loc=torch.from_numpy(query_start).to(device), seq_lens=torch.from_numpy(seq_lens).to(device),
        context_lens=torch.from_numpy(seq_lens - query_lens).to(device), block_table=table.to(device),
        slot_mapping=torch.tensor(slots, device=device), query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)
    query = torch.randn(int(query_start[-1]), heads, head_size, generator=generator).to(dtype)
    return PagedCase(metadata, query.to(device), torch.cat(new_keys).to(device), torch.cat(new_values).to(device),
                     key_cache.to(device), value_cache.to(device))


def run_backend(backend: object, layer: Attention, case: PagedCase) -> torch.Tensor:
    """One step of ``backend`` on ``case``: prepare, then one layer's forward."""
    metadata = case.metadata
    metadata.backend_data = backend.prepare(metadata)  # type: ignore[attr-defined]
    return backend.forward(layer, case.query, case.key, case.value, case.kv_cache(), metadata)  # type: ignore[attr-defined]


def sdpa_reference(layer: Attention, case: PagedCase) -> torch.Tensor:
    from tokenmill_attn_sdpa.backend import SDPABackend

    return run_backend(SDPABackend(), layer, case)
