"""Paged attention for mixed prefill/decode batches with torch SDPA.

Once per step, ``prepare`` turns the block tables into a gather index and a
boolean mask over a padded ``[requests, max_query_len, blocks * block_size]``
grid; each layer then writes its new K/V through the slot mapping, gathers
every request's blocks whole (``index_select`` of block-sized chunks, several
times faster than gathering token rows), and runs one batched SDPA call
(grouped-query attention natively, no repeated KV heads). Key positions past a
request's length read whatever its padding blocks hold; the mask removes them.
An fp8 KV cache (``kv_cache_dtype``) is quantised on write with the layer's
``k_scale``/``v_scale`` and dequantised on the gather (``tokenmill.kv_cache.fp8``).
A layer with a soft cap on its scores (Gemma 2) takes the same gather and mask
through an explicit softmax, since SDPA cannot apply a function to the scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.layers import Attention
from tokenmill.plugin_api import AttentionMetadata, KVCache, gather_blocks, write_kv


@dataclass
class SDPAStepData:
    """Per-step gather indices and masks shared by all layers."""

    block_index: torch.Tensor  # [B * blocks] the blocks to gather, request after request
    query_index: torch.Tensor  # [B, Q] flat token index of each request's query i (0 for padding)
    query_valid: torch.Tensor  # [B, Q] bool
    valid_flat: torch.Tensor  # [T] index of each real query in the flattened [B * Q] grid
    query_pos: torch.Tensor  # [B, Q] sequence position of each query
    key_pos: torch.Tensor  # [S]
    causal: torch.Tensor  # [B, 1, Q, S] bool, True where attention is allowed
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.causal
        if sliding_window not in self.windowed:
            inside = (self.query_pos[:, :, None] - self.key_pos[None, None, :]) < sliding_window
            self.windowed[sliding_window] = self.causal & inside[:, None]
        return self.windowed[sliding_window]


class SDPABackend:
    name = "sdpa"

    def __init__(self, **_: object) -> None:
        pass

    def prepare(self, metadata: AttentionMetadata) -> SDPAStepData:
        device = metadata.slot_mapping.device
        max_q = metadata.max_query_len
        block_table = metadata.block_table
        key_pos = torch.arange(block_table.shape[1] * metadata.block_size, device=device)
        query_offset = torch.arange(max_q, device=device)
        query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
        query_valid = query_offset[None, :] < query_lens[:, None]
        query_index = torch.where(query_valid, metadata.query_start_loc[:-1, None] + query_offset[None, :], 0)
        query_pos = metadata.context_lens[:, None] + query_offset[None, :]
        causal = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < metadata.seq_lens[:, None, None])
        # A padding query row attends to key 0 only, so its softmax stays finite; it is dropped later.
        causal = causal | (~query_valid[:, :, None] & (key_pos == 0)[None, None, :])
        # Built on the host from the CPU copy: boolean-mask indexing on the device
        # would synchronise once per layer.
        starts = metadata.query_start_loc_cpu
        lens = starts[1:] - starts[:-1]
        valid_flat = np.repeat(np.arange(len(lens)) * max_q - starts[:-1], lens) + np.arange(int(starts[-1]))
        valid_flat_t = torch.from_numpy(valid_flat).to(device, non_blocking=True)
        return SDPAStepData(block_table.reshape(-1), query_index, query_valid, valid_flat_t, query_pos, key_pos,
                            causal[:, None])

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        flat_k = key_cache.view(-1, layer.num_kv_heads, layer.head_size)
        flat_v = value_cache.view(-1, layer.num_kv_heads, layer.head_size)
        write_kv(flat_k, metadata.slot_mapping, key, layer.k_scale)
        write_kv(flat_v, metadata.slot_mapping, value, layer.v_scale)

        step: SDPAStepData = metadata.backend_data
        num_reqs, seq = step.query_index.shape[0], step.key_pos.shape[0]
        q = query[step.query_index].transpose(1, 2)  # [B, H, Q, D]
        k = gather_blocks(key_cache, step.block_index, layer.k_scale, query.dtype)
        v = gather_blocks(value_cache, step.block_index, layer.v_scale, query.dtype)
        k = k.view(num_reqs, seq, layer.num_kv_heads, layer.head_size)
        v = v.view(num_reqs, seq, layer.num_kv_heads, layer.head_size)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, S, D]
        mask = step.mask(layer.sliding_window)
        if layer.logits_soft_cap is not None:
            out = soft_capped_attention(q, k, v, mask, layer.scale, layer.logits_soft_cap)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale,
                                                 enable_gqa=layer.num_heads != layer.num_kv_heads)
        out = out.transpose(1, 2).reshape(num_reqs * step.query_index.shape[1], layer.num_heads, layer.head_size)
        return out.index_select(0, step.valid_flat)  # [T, H, D], tokens in batch order


def soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          cap: float) -> torch.Tensor:
    """Attention with ``cap * tanh(score / cap)`` scores, in transformers' order (scale,
    cap, mask, softmax in float32). ``q`` [B, H, Q, D], ``k``/``v`` [B, H_kv, S, D],
    ``mask`` [B, 1, Q, S] (True: attend) -> [B, H, Q, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
