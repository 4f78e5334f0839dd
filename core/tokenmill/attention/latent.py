"""Latent attention over a latent KV cache (``KVCacheSpec`` kind ``"latent"``): the torch/SDPA reference.

Every query head attends to one shared cached entry per token of ``W`` features, the first
``latent_size`` of which are the value: the score of head ``h`` on token ``s`` is ``scale *
query[h] . entry[s]`` over all ``W`` features, and its output the softmax-weighted sum of the
entries' first ``latent_size`` features. That is multi-query attention (one key head) whose
value is a prefix of its key, so one SDPA call does it, the key ``[B, 1, S, W]`` and the value
a view ``[B, 1, S, latent_size]`` of the same gathered blocks. DeepSeek's multi-head latent
attention in its absorbed form is this: an entry is the normed latent then the shared rotary key,
a query is the head's non-rotary query projected into the latent space (through ``kv_b_proj``'s
key half) then its rotary query, and the output goes through the value half of ``kv_b_proj``
afterwards (``tokenmill_models_moe.mla``).

A step's gather index and causal mask are built from the metadata's tensors (with nothing read
back to the host, so a captured step would rebuild them on replay) by the first latent layer of
the step and reused by the others: :func:`latent_step_data` keeps them on the step's metadata
(``AttentionMetadata.latent_data``). An fp8 cache is written and read through ``tokenmill.kv_cache.fp8`` with the
layer's one scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kv_cache.fp8 import gather_blocks, write_kv


@dataclass
class LatentStepData:
    """A step's gather index and mask, shared by its latent layers."""

    block_index: torch.Tensor  # [B * blocks] the blocks to gather, request after request
    query_index: torch.Tensor  # [B, Q] flat token of each request's query i (0 for padding)
    valid_flat: torch.Tensor  # [T] each real query's row in the flattened [B * Q] grid
    mask: torch.Tensor  # [B, 1, Q, S] True where a query may attend


def latent_step_data(metadata: AttentionMetadata) -> LatentStepData:
    """The step's data, built once per step (metadata object) for all its latent layers and kept
    on the metadata (``latent_data``)."""
    if metadata.latent_data is None:
        metadata.latent_data = build_latent_step_data(metadata)
    return cast(LatentStepData, metadata.latent_data)


def build_latent_step_data(metadata: AttentionMetadata) -> LatentStepData:
    device = metadata.slot_mapping.device
    max_q = metadata.max_query_len
    table = metadata.block_table
    starts = metadata.query_start_loc
    key_pos = torch.arange(table.shape[1] * metadata.block_size, device=device)
    offset = torch.arange(max_q, device=device)
    valid = offset[None, :] < (starts[1:] - starts[:-1])[:, None]
    query_index = torch.where(valid, starts[:-1, None] + offset[None, :], 0)
    query_pos = metadata.context_lens[:, None] + offset[None, :]
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < metadata.seq_lens[:, None, None])
    # a padding query row attends to key 0 alone, so its softmax stays finite; it is dropped after
    mask = mask | (~valid[:, :, None] & (key_pos == 0)[None, None, :])
    tokens = torch.arange(metadata.num_actual_tokens, device=device)
    request = torch.searchsorted(starts[1:], tokens, right=True)
    valid_flat = request * max_q + tokens - starts[request]
    return LatentStepData(table.reshape(-1), query_index, valid_flat, mask[:, None])


def write_latent(cache: torch.Tensor, slot_mapping: torch.Tensor, entry: torch.Tensor, scale: float = 1.0) -> None:
    """Store each new token's entry ``[T, W]`` at its slot of ``cache`` ``[blocks, block_size, 1, W]``."""
    width = cache.shape[-1]
    write_kv(cache.view(-1, 1, width), slot_mapping, entry.view(-1, 1, width), scale)


def latent_attention(query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                     latent_size: int, cache_scale: float = 1.0) -> torch.Tensor:
    """``query`` [T, H, W] against the cached entries of each query's request (the new tokens'
    already written) -> [T, H, latent_size]: causal, over ``cache`` [blocks, block_size, 1, W]."""
    step = latent_step_data(metadata)
    num_reqs, max_q = step.query_index.shape
    heads, width = query.shape[1], cache.shape[-1]
    entries = gather_blocks(cache, step.block_index, cache_scale, query.dtype).view(num_reqs, 1, -1, width)
    q = query[step.query_index].transpose(1, 2)  # [B, H, Q, W]
    out = F.scaled_dot_product_attention(q, entries, entries[..., :latent_size], attn_mask=step.mask, scale=scale,
                                         enable_gqa=heads > 1)
    out = out.transpose(1, 2).reshape(num_reqs * max_q, heads, latent_size)
    return out.index_select(0, step.valid_flat)
