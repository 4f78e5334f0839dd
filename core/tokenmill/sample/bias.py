"""Per-request sparse edits of the logits: OpenAI ``logit_bias`` and ``min_tokens``.

Both come as per-row Python dicts, so the (row, token) pairs are collected
on the host and written with a single indexed kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_logit_bias", "apply_min_tokens"]


def apply_logit_bias(
    logits: torch.Tensor, logit_bias: Sequence[dict[int, float] | None]
) -> torch.Tensor:
    """Add each row's ``{token: bias}`` to ``logits`` ``[B, V]`` in place.

    Token ids outside the vocabulary are skipped: request validation should
    have rejected them, and an out-of-range index here would kill the step.
    """
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(logit_bias):
        if not bias:
            continue
        for token, value in bias.items():
            if 0 <= token < vocab_size:
                rows.append(row)
                cols.append(token)
                values.append(value)
    if rows:
        index = _index(rows, cols, logits.device)
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)
    return logits


def apply_min_tokens(
    logits: torch.Tensor,
    min_tokens: dict[int, tuple[int, set[int]]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Mask the stop ids of rows that have not yet generated ``min_tokens`` tokens, in place."""
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for row, (minimum, stop_ids) in min_tokens.items():
        if len(output_token_ids[row]) >= minimum:
            continue
        for token in stop_ids:
            if 0 <= token < vocab_size:
                rows.append(row)
                cols.append(token)
    if rows:
        logits[_index(rows, cols, logits.device)] = float("-inf")
    return logits


def _index(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    )
