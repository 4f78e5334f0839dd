"""Sampling draft tokens from a draft model's own distribution, for speculative decoding.

A draft drawn from the draft's distribution ``q`` at the request's sampling parameters is
accepted more often than its argmax (rejection sampling accepts with ``min(1, p/q)``), and
the rejection sampler needs that same ``q`` to stay exact. So ``q`` is computed the way the
target's ``p`` is (:func:`~tokenmill.sample.rejection_sampler.target_probs`: temperature,
min-p, top-k, top-p; a greedy row's is the one-hot on its argmax) and the draft is drawn
from exactly that tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sample.metadata import GREEDY_EPS, SamplingMetadata
from tokenmill.sample.ops import inverse_cdf_sample
from tokenmill.sample.rejection_sampler import target_probs
from tokenmill.sample.sampler import Sampler, SamplerOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["DraftSampler", "SampledDrafts", "draft_sampling_params", "sample_drafts", "samples_drafts"]


@dataclass
class SampledDrafts:
    token_ids: torch.Tensor  # [B] int64
    probs: torch.Tensor  # [B, V] float32: the distribution each token was drawn from


def sample_drafts(logits: torch.Tensor, metadata: SamplingMetadata) -> SampledDrafts:
    """One draft token per row of ``logits`` ``[B, V]``, drawn from the row's ``q`` (greedy
    rows: the argmax, as the ordinary sampler takes it); seeded rows draw from
    ``metadata.generators``."""
    probs = target_probs(logits.float(), metadata)
    tokens = probs.max(dim=-1).indices  # a greedy row's q is one-hot: its argmax is the logits' argmax
    if not metadata.all_greedy:
        drawn = inverse_cdf_sample(probs, metadata.generators)
        tokens = torch.where(metadata.temperature < GREEDY_EPS, tokens, drawn)
    return SampledDrafts(tokens, probs)


class DraftSampler(Sampler):
    """A model runner's sampler for a draft model: draws as :func:`sample_drafts` does and
    keeps each call's ``q`` (``last_probs``, rows in the order of the runner's sampled rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.last_probs: torch.Tensor | None = None

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        drafts = sample_drafts(logits, metadata)
        self.last_probs = drafts.probs
        return SamplerOutput(sampled_token_ids=drafts.token_ids, logprobs=None)


def samples_drafts(params: SamplingParams | None) -> bool:
    """Whether a request's drafts are drawn from ``q`` (else: the argmax, a one-hot ``q``).

    Not for a request with structured outputs: the scheduler cuts its drafts at the first one
    its grammar forbids, a cut that depends on the drafts' values, after which the target draws
    from ``p`` instead of the residual; with a one-hot ``q`` that is the same distribution
    (``p`` is zero on the forbidden draft), with a sampled one it is not."""
    return params is not None and not params.is_greedy and params.structured_outputs is None


def draft_sampling_params(params: SamplingParams | None, position: int) -> SamplingParams:
    """The draft's parameters for a request's drafts proposed after ``position`` tokens: the
    request's temperature and truncation (none of its penalties, biases or stop rules: ``q``
    may be any distribution, so long as the rejection sampler is told it). A seeded request's
    draft seed mixes in ``position``, so the drafts of successive steps draw fresh numbers
    while the output stays reproducible."""
    if params is None or not samples_drafts(params):
        return SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    seed = None if params.seed is None else (params.seed * 1_000_003 + position) % (1 << 63)
    return SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                          min_p=params.min_p, seed=seed, max_tokens=1 << 20, ignore_eos=True)
