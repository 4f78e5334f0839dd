"""Bidirectional (non-causal) attention for encoder models, without a KV cache.

An encoder (BERT, RoBERTa) attends every token of a sequence to every other, so
it needs the whole sequence in one step: the scheduler never chunks such a
model's prompts (``SchedulerConfig.non_causal_prefill``) and nothing is cached,
since nothing is decoded afterwards. The step's tokens come flattened, request
after request (``AttentionMetadata.query_start_loc``); :class:`EncoderBatch`,
built once per forward, pads them to ``[requests, longest, ...]`` with a key mask,
and :func:`bidirectional_attention` runs one batched SDPA call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


@dataclass
class EncoderBatch:
    """Where each flattened token sits in the padded ``[requests, longest]`` grid."""

    num_reqs: int
    longest: int
    gather: torch.Tensor  # [B * L] flat token index of each grid cell (0 for padding)
    scatter: torch.Tensor  # [T] grid cell of each real token
    key_mask: torch.Tensor  # [B, 1, 1, L] True where the key is a real token

    @classmethod
    def from_metadata(cls, metadata: AttentionMetadata, device: torch.device) -> EncoderBatch:
        starts = metadata.query_start_loc_cpu
        lens = starts[1:] - starts[:-1]
        if np.any(metadata.seq_lens_cpu != lens):  # a request with tokens from an earlier step
            raise RuntimeError("bidirectional attention needs each sequence whole in one step (a request was "
                               "chunked: the scheduler must run with non_causal_prefill)")
        num_reqs, longest = len(lens), int(lens.max())
        offsets = np.arange(longest)
        valid = offsets[None, :] < lens[:, None]
        gather = np.where(valid, starts[:-1, None] + offsets[None, :], 0).reshape(-1)
        scatter = np.flatnonzero(valid.reshape(-1))

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        return cls(num_reqs, longest, to_device(gather), to_device(scatter),
                   to_device(valid)[:, None, None, :])


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: EncoderBatch,
                            scale: float) -> torch.Tensor:
    """``q``, ``k``, ``v`` [T, H, D] -> [T, H, D]: each token attends to every token of its own sequence."""
    heads, head_size = q.shape[1], q.shape[2]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [B, H, L, D]
        return x.index_select(0, batch.gather).view(batch.num_reqs, batch.longest, heads, head_size).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=batch.key_mask, scale=scale)
    out = out.transpose(1, 2).reshape(batch.num_reqs * batch.longest, heads, head_size)
    return out.index_select(0, batch.scatter)
