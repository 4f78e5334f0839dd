"""Logprobs of chosen tokens plus the top-k alternatives, for outputs and prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["LogprobsLists", "LogprobsTensors", "compute_logprobs", "compute_prompt_logprobs", "gather_logprobs"]


class LogprobsLists(NamedTuple):
    """:class:`LogprobsTensors` as Python lists, for the output processor."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class LogprobsTensors:
    """Per-row logprobs: column 0 is the chosen token, columns 1..k the top-k.

    ``ranks`` is the 1-based rank of the chosen token in the distribution
    (1 + the number of tokens strictly more likely).
    """

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax in float32 whatever the logits' dtype: bf16 logprobs are too coarse."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Pick ``token_ids``' logprobs and ranks and the ``num_logprobs`` best from ``[N, V]`` logprobs.

    ``num_logprobs`` larger than the vocabulary is cut to the vocabulary.
    """
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(num_logprobs, logprobs.shape[-1])
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        chosen = torch.cat([chosen, top_logprobs], dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=chosen, ranks=ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Prompt logprobs from ``[T, V]`` logits; column 0 is the actual next prompt token.

    Like sampled logprobs, these come from the raw logits, before any
    sampling parameter touches them.
    """
    return gather_logprobs(compute_logprobs(logits), next_token_ids, num_logprobs)
