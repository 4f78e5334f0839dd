"""Structured outputs in the sampler: mask, in one vectorised pass, the tokens
each constrained row's grammar forbids this step."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from tokenmill.scheduler.output import GrammarBitmask

__all__ = ["apply_grammar_bitmask", "apply_token_bitmask", "bitmask_penalty"]


class _HasReqId(Protocol):
    req_id: str


@functools.cache
def _byte_penalties(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 8]``: for each byte value, 0 where bit ``k`` is set and -inf where it is not."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(dtype=dtype, device=device)


def bitmask_penalty(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[R, W]`` bit-packed int32 -> ``[R, vocab_size]`` additive mask: 0 allowed, -inf forbidden.

    The int32 words are read as little-endian bytes (bit ``j`` of word ``i`` is
    bit ``j % 8`` of byte ``4i + j // 8``), and each byte expands to eight
    values with one table lookup: about twice as fast on the CPU as shifting
    every word 32 times, and faster than a boolean ``masked_fill``.
    Tokens past the bitmask (a lm_head wider than the grammar's vocabulary)
    are forbidden: no grammar can have produced them.
    """
    table = _byte_penalties(dtype, bitmask.device)
    penalty = torch.nn.functional.embedding(bitmask.contiguous().view(torch.uint8).long(), table).flatten(1)
    if penalty.shape[1] < vocab_size:
        penalty = torch.nn.functional.pad(penalty, (0, vocab_size - penalty.shape[1]), value=float("-inf"))
    return penalty[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Set to ``-inf``, in place, the logits the bitmask forbids: bitmask row ``i``
    governs ``logits[rows[i]]``; other rows are left alone."""
    if len(rows) == 0:
        return logits
    penalty = bitmask_penalty(bitmask.to(logits.device, non_blocking=True), logits.shape[-1], logits.dtype)
    if list(rows) == list(range(logits.shape[0])):
        return logits.add_(penalty)
    index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    return logits.index_add_(0, index, penalty)


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask | None,
                          states: Sequence[_HasReqId]) -> torch.Tensor:
    """Apply the step's grammar bitmask to ``logits``, whose row ``i`` samples for ``states[i]``."""
    if grammar is None:
        return logits
    pairs = [(i, grammar.rows[s.req_id]) for i, s in enumerate(states) if s.req_id in grammar.rows]
    if not pairs:
        return logits
    logit_rows, mask_rows = zip(*pairs, strict=True)
    whole = list(mask_rows) == list(range(grammar.bitmask.shape[0]))  # (draft rows follow the others)
    bitmask = grammar.bitmask if whole else grammar.bitmask[list(mask_rows)]
    return apply_token_bitmask(logits, bitmask, logit_rows)
