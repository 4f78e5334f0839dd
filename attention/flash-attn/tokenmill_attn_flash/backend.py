"""Paged attention with FlashAttention 2's ``flash_attn_varlen_func`` and its ``block_table``.

The varlen kernel takes the whole mixed batch at once: the new queries packed
(``cu_seqlens_q``), each request's keys read straight from its cache pages through the
block table (``cu_seqlens_k`` from the sequence lengths), causal aligned to the end of
each sequence, so a decode, a chunk of a prefill and a whole prompt are the same call.
``prepare`` casts the step's tables to the int32 the kernel wants, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.layers import Attention
from tokenmill.plugin_api import AttentionMetadata, KVCache


@dataclass
class FlashStepData:
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_reqs + 1] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int


def cumulative_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32 (the kernels' ``cu_seqlens``)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def write_kv(kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The new tokens' K and V into their slots of the flattened ``[blocks * block_size]`` cache."""
    key_cache, value_cache = kv_cache
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """FlashAttention's ``(left, right)``: a query at ``p`` sees keys ``p - left .. p + right``;
    tokenmill's window keeps keys with ``p - k < sliding_window``."""
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


class FlashAttentionBackend:
    name = "flash-attn"

    def __init__(self, block_size: int = 16, **_: Any) -> None:
        from flash_attn import flash_attn_varlen_func  # not installed: the engine takes the next backend

        if block_size % 256:
            raise ValueError(f"flash-attn's paged path needs a block size that is a multiple of 256, not {block_size}")
        self._varlen = flash_attn_varlen_func

    def prepare(self, metadata: AttentionMetadata) -> FlashStepData:
        return FlashStepData(
            cu_seqlens_q=metadata.query_start_loc.to(torch.int32),
            cu_seqlens_k=cumulative_lengths(metadata.seq_lens),
            block_table=metadata.block_table.to(torch.int32),
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
        )

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        step: FlashStepData = metadata.backend_data
        key_cache, value_cache = kv_cache
        out: torch.Tensor = self._varlen(
            query, key_cache, value_cache, step.cu_seqlens_q, step.cu_seqlens_k, step.max_seqlen_q,
            step.max_seqlen_k, softmax_scale=layer.scale, causal=True,
            window_size=window_size(layer.sliding_window), softcap=layer.logits_soft_cap or 0.0,
            block_table=step.block_table,
        )
        return out
