"""Paged-attention cases shared by the interpreted and the GPU tests: a batch of
requests, each ``(tokens already cached, new tokens)``, laid out in a randomly
permuted block pool, and the SDPA reference's answer on the same inputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.layers import Attention
from tokenmill.plugin_api import AttentionMetadata
from tokenmill_attn_sdpa.backend import SDPABackend


@dataclass(frozen=True)
class Case:
    requests: tuple[tuple[int, int], ...]  # (context_len, query_len) per request
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 16
    sliding_window: int | None = None
    soft_cap: float | None = None
    query_scale: float = 1.0  # larger queries give larger scores, which the soft cap then bends


# prompts, decodes, and a chunk after a cached prefix
MIXED = ((0, 19), (40, 1), (17, 1), (0, 3), (33, 12))
CASES = {
    "prefill-only": Case(((0, 20), (0, 7), (0, 1))),
    "decode-only": Case(((30, 1), (5, 1), (64, 1), (15, 1))),
    "mixed": Case(MIXED),
    "chunked-prefill-after-prefix": Case(((37, 12), (16, 16), (64, 30))),
    "sliding-window": Case(((40, 9), (50, 1), (0, 20), (3, 1)), sliding_window=8),
    "sliding-window-wider-than-a-key-tile": Case(((70, 5), (90, 1)), sliding_window=45),
    "soft-cap": Case(MIXED, soft_cap=5.0, query_scale=4.0),
    "soft-cap-and-window": Case(MIXED, soft_cap=5.0, query_scale=4.0, sliding_window=10),
    "gqa-1": Case(MIXED, num_heads=4, num_kv_heads=4),
    "gqa-2": Case(MIXED, num_heads=4, num_kv_heads=2),
    "gqa-4": Case(MIXED, num_heads=8, num_kv_heads=2),
    "gqa-3-padded-group": Case(MIXED, num_heads=6, num_kv_heads=2),
    "block-size-32": Case(MIXED, block_size=32),
    "block-size-8": Case(MIXED, block_size=8),
    "head-size-24": Case(MIXED, head_size=24),
    "head-size-160-narrow-prefill-tiles": Case(((0, 40), (20, 1), (5, 17)), num_heads=2, num_kv_heads=1,
                                               head_size=160),
    "one-request-long-prompt": Case(((0, 70),), num_heads=2, num_kv_heads=1),
}


@dataclass
class Inputs:
    layer: Attention
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: AttentionMetadata


def build_inputs(case: Case, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Inputs:
    generator = torch.Generator().manual_seed(seed)
    context = np.array([c for c, _ in case.requests], dtype=np.int64)
    query_lens = np.array([q for _, q in case.requests], dtype=np.int64)
    seq_lens = context + query_lens
    blocks_per_request = -(-seq_lens // case.block_size)
    max_blocks = int(blocks_per_request.max())
    num_blocks = int(blocks_per_request.sum()) + 3  # spare blocks hold garbage no request may read
    pool = torch.randperm(num_blocks, generator=generator).numpy()
    block_table = np.zeros((len(case.requests), max_blocks), dtype=np.int64)
    taken = 0
    for i, count in enumerate(blocks_per_request):
        block_table[i, :count] = pool[taken:taken + count]
        taken += count
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    token_request = np.repeat(np.arange(len(case.requests)), query_lens)
    positions = context[token_request] + np.arange(int(query_start[-1])) - query_start[:-1][token_request]
    slots = block_table[token_request, positions // case.block_size] * case.block_size + positions % case.block_size

    def random(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    tokens = int(query_start[-1])
    cache_shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    layer = Attention(case.num_heads, case.head_size, case.num_kv_heads, case.head_size**-0.5, case.sliding_window,
                      logits_soft_cap=case.soft_cap)

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    metadata = AttentionMetadata(
        num_reqs=len(case.requests), num_actual_tokens=tokens, max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=case.block_size, query_start_loc=on_device(query_start),
        seq_lens=on_device(seq_lens), context_lens=on_device(context), block_table=on_device(block_table),
        slot_mapping=on_device(slots), query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)
    return Inputs(layer, random(tokens, case.num_heads, case.head_size, scale=case.query_scale),
                  random(tokens, case.num_kv_heads, case.head_size), random(tokens, case.num_kv_heads, case.head_size),
                  random(*cache_shape), random(*cache_shape), metadata)


def run_backend(backend, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backend's output and the caches it leaves, on copies of the inputs' caches."""
    key_cache, value_cache = inputs.key_cache.clone(), inputs.value_cache.clone()
    metadata = inputs.metadata
    metadata.backend_data = backend.prepare(metadata)
    out = backend.forward(inputs.layer, inputs.query, inputs.key, inputs.value, (key_cache, value_cache), metadata)
    metadata.backend_data = None
    return out, key_cache, value_cache


def sdpa_reference(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference backend on the same inputs, in float32."""
    as_float = Inputs(inputs.layer, inputs.query.float(), inputs.key.float(), inputs.value.float(),
                      inputs.key_cache.float(), inputs.value_cache.float(), inputs.metadata)
    return run_backend(SDPABackend(), as_float)
