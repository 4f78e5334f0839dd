"""Bidirectional attention within an image's tokens, over the paged KV cache.

Gemma 3's language model lets the tokens of one image attend to each other both ways (what
transformers builds from ``token_type_ids``: causal OR same-image, and for a sliding layer that
AND the window ``key > query - window``); every other token stays causal, and decode tokens are
never an image's. The scheduler keeps each such image whole in one step
(``SchedulerConfig.whole_mm_items``): a query of an image needs the keys of the image's later
tokens, which a chunk that ended inside the image would not have computed yet.

A step lists those images in ``AttentionMetadata.bidirectional_blocks``. A backend that reads
the list itself says so with ``supports_bidirectional_blocks = True``; for any other one the
``Attention`` layer lets the backend write the KV and attend causally as usual, then recomputes
the rows of each image's queries here, against the request's cached keys up to the image's end.
The recomputation costs one small attention per image and layer in the steps that hold images,
and it keeps the paged backends (and their kernels) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.kv_cache.fp8 import gather_blocks

if TYPE_CHECKING:
    from tokenmill.attention.backend import KVCache
    from tokenmill.attention.metadata import AttentionMetadata
    from tokenmill.layers.attention import Attention


@dataclass(frozen=True)
class BidirectionalBlock:
    """The query rows ``[first, last)`` of the step's flattened tokens are one image's tokens of
    request ``request`` (its row in ``AttentionMetadata.block_table``), at sequence positions
    ``position ..``; each attends to every key of the request before ``key_end`` (the image's
    end), within the layer's sliding window."""

    request: int
    first: int
    last: int
    position: int
    key_end: int


def attend_blocks(layer: Attention, query: torch.Tensor, out: torch.Tensor, kv_cache: KVCache,
                  metadata: AttentionMetadata) -> torch.Tensor:
    """``out`` ``[T, H, D]`` (the backend's causal output for ``query`` ``[T, H, D]``) with each
    block's rows replaced by their bidirectional attention; the blocks' keys must already be in
    ``kv_cache`` (the backend wrote them)."""
    key_cache, value_cache = kv_cache
    block_size = key_cache.shape[1]
    groups = layer.num_heads // layer.num_kv_heads
    for block in metadata.bidirectional_blocks or ():
        num_blocks = -(-block.key_end // block_size)
        ids = metadata.block_table[block.request, :num_blocks]
        k = gather_blocks(key_cache, ids, layer.k_scale, query.dtype).reshape(-1, layer.num_kv_heads, layer.head_size)
        v = gather_blocks(value_cache, ids, layer.v_scale, query.dtype).reshape(-1, layer.num_kv_heads, layer.head_size)
        k, v = k[:block.key_end].transpose(0, 1), v[:block.key_end].transpose(0, 1)  # [H_kv, S, D]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        q = query[block.first:block.last].transpose(0, 1)  # [H, Q, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * layer.scale
        if layer.logits_soft_cap is not None:
            scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
        if layer.sliding_window is not None:
            query_pos = torch.arange(block.position, block.position + q.shape[1], device=q.device)
            key_pos = torch.arange(block.key_end, device=q.device)
            outside = key_pos[None, :] <= query_pos[:, None] - layer.sliding_window
            scores = scores.masked_fill(outside, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out[block.first:block.last] = torch.matmul(weights, v).transpose(0, 1)
    return out
