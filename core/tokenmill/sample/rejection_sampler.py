"""Verifying draft tokens, vectorised over the batch, so that the output has exactly the
target model's distribution (speculative sampling, Leviathan et al. 2023; Chen et al. 2023).

Each request ``b`` brings ``k_b`` draft tokens ``d_0 .. d_{k_b-1}`` and ``k_b + 1`` rows of
target logits: row ``j`` is the target's distribution ``p_j`` of the token after ``d_{j-1}``
(row 0: after the last sampled token). With ``q_j`` the distribution the draft came from
(a one-hot on ``d_j`` for a proposer without probabilities, e.g. n-gram lookup):

* draft ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, in order, until
  the first rejection;
* at the first rejected position ``j`` the token is drawn from
  ``normalise(max(0, p_j - q_j))``; if every draft was accepted, a bonus token is drawn from
  ``p_{k_b}``.

A greedy request's ``p_j`` is the one-hot on its argmax: then a draft is accepted exactly
when it is the argmax, and the token after the accepted run is the argmax too, so greedy
output is token-identical to decoding without speculation. ``p_j`` is what the ordinary
sampler would draw from: the logits after bias, min-tokens and penalties (the caller's
job, per position), then temperature, min-p, top-k and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sample.metadata import GREEDY_EPS, SamplingMetadata
from tokenmill.sample.ops import _uniforms, apply_min_p, apply_temperature, apply_top_k_top_p, inverse_cdf_sample

__all__ = ["RejectionSamplerOutput", "rejection_sample", "target_probs"]


@dataclass
class RejectionSamplerOutput:
    token_ids: list[list[int]]  # per request: its accepted drafts, then one token more
    position_tokens: torch.Tensor  # [N] the token chosen at each logits row (valid up to each run's end)


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """``[N, V]`` float32: each row's sampling distribution; a greedy row's is the one-hot on its argmax."""
    greedy = metadata.temperature < GREEDY_EPS
    argmax = logits.max(dim=-1).indices
    onehot = torch.zeros_like(logits, dtype=torch.float32).scatter_(1, argmax.unsqueeze(1), 1.0)
    if metadata.all_greedy:
        return onehot
    scaled = apply_temperature(logits.float(), metadata.temperature)
    if metadata.min_p is not None:
        scaled = apply_min_p(scaled, metadata.min_p)
    scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    return torch.where(greedy.unsqueeze(1), onehot, probs)


def rejection_sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
) -> RejectionSamplerOutput:
    """Verify every request's drafts at once.

    ``logits`` ``[N, V]`` (``N = sum(k_b + 1)``, requests in order) and ``metadata`` (one row
    per logits row) are the target's, already through the logits processors.
    ``generators[b]``: request ``b``'s seeded generator, which draws all of its random numbers.
    ``draft_probs`` ``[N, V]``: ``q`` on the rows of the drafts (the last row of each request
    ignored); None: each draft came with probability 1.
    """
    device = logits.device
    counts = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.int64)
    num_rows = int(counts.sum()) + len(draft_token_ids)
    if logits.shape[0] != num_rows:
        raise ValueError(f"{logits.shape[0]} logits rows for {num_rows} verified positions")
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)
    probs = target_probs(logits, metadata)

    # Each row's draft token (the next draft after the row's prefix); a request's last row has none.
    is_draft_row = torch.ones(num_rows, dtype=torch.bool)
    is_draft_row[starts + counts] = False
    drafts = torch.zeros(num_rows, dtype=torch.int64)
    drafts[is_draft_row] = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.int64)
    drafts, is_draft_row = drafts.to(device), is_draft_row.to(device)

    row_generators = {row: g for b, g in enumerate(generators) if g is not None
                      for row in range(int(starts[b]), int(starts[b] + counts[b]) + 1)}
    uniform = _uniforms(num_rows, device, torch.float32, row_generators)
    p_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = probs.scatter(1, drafts.unsqueeze(1), 0.0)  # max(0, p - onehot(d))
    else:
        q = draft_probs.float()
        q_draft = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
        residual = (probs - q).clamp_(min=0.0)
    accepted = (uniform * q_draft < p_draft) & is_draft_row  # P = min(1, p/q)
    # The row after a rejection, or the bonus row, draws from the residual, or from p itself.
    residual = torch.where(is_draft_row.unsqueeze(1), residual, probs)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q there: a rejection cannot happen
    residual = torch.where(empty, probs, residual)
    drawn = inverse_cdf_sample(residual, row_generators)
    greedy_rows = metadata.temperature < GREEDY_EPS
    drawn = torch.where(greedy_rows, probs.max(dim=-1).indices, drawn)

    # Accepted drafts per request: the length of its leading run of acceptances, found with
    # one cumulative sum (a row's running count of rejections is 0 exactly inside the run).
    rejections = torch.cumsum((~accepted).to(torch.int64), 0)
    before_start = torch.where(starts > 0, rejections[(starts - 1).clamp(min=0).to(device)], 0)
    owner = torch.repeat_interleave(torch.arange(len(draft_token_ids), device=device), (counts + 1).to(device))
    in_run = (rejections - before_start[owner] == 0) & is_draft_row
    num_accepted = torch.zeros(len(draft_token_ids), dtype=torch.int64, device=device).index_add_(
        0, owner, in_run.to(torch.int64))
    last = drawn[starts.to(device) + num_accepted]
    tokens = [[*draft[:n], t] for draft, n, t in zip(draft_token_ids, num_accepted.tolist(), last.tolist(), strict=True)]
    position_tokens = torch.where(accepted, drafts, drawn)
    return RejectionSamplerOutput(tokens, position_tokens)
