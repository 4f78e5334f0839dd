"""Batched logits transforms for random sampling, and the random draw itself.

Every function takes float32 logits ``[B, V]`` that the sampler owns and may
modify them in place; masked tokens become ``-inf``.
"""

from __future__ import annotations

import torch

from tokenmill.sample.metadata import GREEDY_EPS

__all__ = [
    "apply_min_p",
    "apply_temperature",
    "apply_top_k_top_p",
    "inverse_cdf_sample",
    "random_sample",
]

_NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature, in place.

    Greedy rows (temperature ~0) are divided by 1 instead: their random draw
    is discarded, but a division by zero would spread NaN/inf through it.
    """
    safe = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)
    return logits.div_(safe.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    # min_p == 0 gives threshold 0, and no probability is < 0: row untouched.
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the ``top_k`` largest logits, then the top-``top_p`` nucleus of the rest.

    One ascending sort serves both. Top-k keeps every token tied with the
    k-th largest logit. Top-p keeps the smallest set of most likely tokens
    whose probability (renormalised after top-k) sums to at least ``top_p``,
    and always the most likely token. ``top_k`` 0 and ``top_p`` 1 are off.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)

    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
        # In ascending order the k-th largest logit sits at V - k.
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)

    if top_p is not None:
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop the largest tail of unlikely tokens whose mass is <= 1 - p;
        # what remains has mass >= p and is the smallest such set.
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # float error must never drop the top token
        sorted_logits.masked_fill_(drop, _NEG_INF)

    # Put the (partly masked) values back at their vocabulary positions.
    return logits.scatter_(-1, order, sorted_logits)


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from ``probs`` ``[B, V]`` by inverting its cumulative sum.

    One uniform number per row, scaled to the row's total mass, finds the
    first token whose cumulative mass exceeds it (so a zero-probability token
    is never chosen). On the CPU this is ~8x cheaper than the exponential race
    (``argmax(probs / Exp(1))``), which needs a random number per vocabulary
    entry. Seeded rows draw their number from their own generator, so their
    token depends only on their own probabilities and seed, never on the other
    rows of the batch.
    """
    cumulative = probs.cumsum(dim=-1)
    uniform = torch.rand(probs.shape[0], 1, device=probs.device, dtype=cumulative.dtype)
    for row, generator in generators.items():
        uniform[row] = torch.rand(1, generator=generator, device=probs.device, dtype=cumulative.dtype)
    threshold = uniform * cumulative[:, -1:]
    tokens = torch.searchsorted(cumulative, threshold, right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def random_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, then the random draw: ``[B]`` int64 tokens."""
    logits = apply_temperature(logits, temperature)
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return inverse_cdf_sample(probs, generators)
