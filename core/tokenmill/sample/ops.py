"""Batched logits transforms for random sampling, and the random draw itself.

Every function takes float32 logits ``[B, V]``; all but ``apply_temperature``
(which the random path applies first) modify them in place. Masked tokens
become ``-inf``.
"""

from __future__ import annotations

import torch

from tokenmill.sample.kernels import sampling_kernels
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
    """Each row divided by its temperature, as a new tensor (the sampler relies on
    this to leave its caller's logits untouched; the edits after it are in place).

    Greedy rows (temperature ~0) are divided by 1 instead: their random draw
    is discarded, but a division by zero would spread NaN/inf through it.
    """
    return logits / _safe_temperature(temperature).unsqueeze(1)


def _safe_temperature(temperature: torch.Tensor) -> torch.Tensor:
    return torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)


def _uniforms(rows: int, device: torch.device, dtype: torch.dtype,
              generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One uniform number per row; seeded rows draw theirs from their own generator."""
    uniform = torch.rand(rows, device=device, dtype=dtype)
    for row, generator in generators.items():
        uniform[row] = torch.rand(1, generator=generator, device=device, dtype=dtype)
    return uniform


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


# Tokens per chunk of the two-level cumulative sum in inverse_cdf_sample.
_CDF_CHUNK = 256


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from ``probs`` ``[B, V]`` (unnormalised is fine) by inverting
    its cumulative sum.

    One uniform number per row, scaled to the row's total mass, finds the first
    token whose cumulative mass exceeds it (so a zero-probability token is never
    chosen). The cumulative sum is taken in two levels: over chunk masses to find
    the chunk, then inside that one chunk, which reads the row once instead of
    writing a whole ``[B, V]`` running sum (the full ``cumsum`` was the sampler's
    largest cost on the CPU). It also beats the exponential race
    (``argmax(probs / Exp(1))``), which needs a random number per vocabulary entry.
    Seeded rows draw their number from their own generator, so their token depends
    only on their own probabilities and seed, never on the other rows of the batch.
    """
    rows, vocab = probs.shape
    uniform = _uniforms(rows, probs.device, probs.dtype, generators).unsqueeze(1)

    full = vocab // _CDF_CHUNK * _CDF_CHUNK
    chunk_mass = probs[:, :full].reshape(rows, full // _CDF_CHUNK, _CDF_CHUNK).sum(-1)
    if full < vocab:
        chunk_mass = torch.cat((chunk_mass, probs[:, full:].sum(-1, keepdim=True)), dim=1)
    chunk_cumulative = chunk_mass.cumsum(-1)
    threshold = uniform * chunk_cumulative[:, -1:]
    chunk = torch.searchsorted(chunk_cumulative, threshold, right=True).clamp_(max=chunk_mass.shape[1] - 1)
    mass_before = torch.where(chunk > 0, chunk_cumulative.gather(1, (chunk - 1).clamp_(min=0)), 0.0)

    columns = chunk * _CDF_CHUNK + torch.arange(_CDF_CHUNK, device=probs.device)
    inside = columns < vocab
    within = (probs.gather(1, columns.clamp(max=vocab - 1)) * inside).cumsum(-1)
    # Summed in another order, the chunk's own total can fall a hair below the
    # residual: cap it just under that total, which lands on the chunk's last
    # token with mass.
    residual = torch.minimum(threshold - mass_before, torch.nextafter(within[:, -1:], torch.zeros_like(threshold)))
    offset = torch.searchsorted(within, residual, right=True).clamp_(max=_CDF_CHUNK - 1)
    return (chunk * _CDF_CHUNK + offset).squeeze(1).clamp_(max=vocab - 1)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (first maximum on ties, as ``max(dim=-1).indices``): ``[B]`` int64, by the
    platform's kernel where it has one for float32 logits (kernels registered before ``argmax``
    was part of ``SamplingKernels`` keep torch's)."""
    kernels = sampling_kernels(logits.device)
    argmax = getattr(kernels, "argmax", None)
    if argmax is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[-1] > 0:
        return argmax(logits)
    # max(...).indices is argmax (first maximum on ties), about 3x faster than argmax on the CPU
    return logits.max(dim=-1).indices


def random_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, then the random draw: ``[B]`` int64 tokens."""
    kernels = sampling_kernels(logits.device)
    if kernels is not None and min_p is None and top_k is None and top_p is None and logits.dtype == torch.float32:
        uniform = _uniforms(logits.shape[0], logits.device, torch.float32, generators)
        return kernels.temperature_sample(logits, _safe_temperature(temperature), uniform)
    logits = apply_temperature(logits, temperature)
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return inverse_cdf_sample(probs, generators)
