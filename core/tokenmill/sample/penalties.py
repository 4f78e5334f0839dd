"""Repetition, frequency and presence penalties, for the whole batch at once."""

from __future__ import annotations

import torch

__all__ = ["apply_penalties", "token_counts"]


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each token occurs per row: ``[B, L]`` ids -> ``[B, vocab_size]`` int64.

    Ids ``>= vocab_size`` are padding: they land in one extra bin that is
    dropped, which spares a mask over the padded tensor.
    """
    rows = token_ids.shape[0]
    # Clamp so any pad id >= vocab_size (not just exactly vocab_size) is safe.
    bins = token_ids.clamp(max=vocab_size)
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, bins, torch.ones_like(bins))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Penalise ``logits`` ``[B, V]`` for tokens already seen; returns new logits.

    - repetition (HF/CTRL): a token seen in the prompt or the output has a
      positive logit divided by the penalty, a non-positive one multiplied;
    - frequency (OpenAI): minus ``penalty * count`` of the token in the output;
    - presence (OpenAI): minus ``penalty`` if the token is in the output at all.

    ``prompt_token_ids`` and ``output_token_ids`` are padded with an id
    ``>= V``; a ``None`` prompt means only the output counts as seen.
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab_size)
    in_output = output_counts > 0
    seen = in_output
    if prompt_token_ids is not None:
        seen = seen | (token_counts(prompt_token_ids, vocab_size) > 0)

    # A penalty below float32's smallest normal (5e-324 from a JSON client) would be 0 here: -inf
    # (a grammar-masked token) times 0 is NaN. Clamped, a huge quotient is at most float's max,
    # and -inf stays -inf, so masked tokens stay masked.
    finfo = torch.finfo(logits.dtype)
    repetition = repetition_penalties.to(logits.dtype).clamp(min=finfo.tiny).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    penalised = torch.nan_to_num(penalised, posinf=finfo.max, neginf=float("-inf"))
    # Rows with penalty 1 compute penalised == logits, so no per-row branch.
    logits = torch.where(seen, penalised, logits)

    logits = logits - frequency_penalties.unsqueeze(1) * output_counts.to(logits.dtype)
    logits = logits - presence_penalties.unsqueeze(1) * in_output.to(logits.dtype)
    return logits
