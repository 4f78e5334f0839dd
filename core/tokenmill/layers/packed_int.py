"""Packed integer weights: unpacking, grouped dequantisation, and the torch linear on them.

A building block of the quantization plugins that store sub-byte ints in int32
words (GPTQ, AWQ, compressed-tensors' pack-quantized): each keeps its own layout
and parameter names, and all multiply through these functions.

GPTQ-style checkpoints hold ``bits``-wide unsigned values packed into int32 words,
the first value in the lowest bits: a word of 4-bit values ``v0..v7`` is
``v0 | v1 << 4 | ... | v7 << 28``. ``qweight`` packs along the input dimension
(``[K / per_word, N]``), ``qzeros`` along the output dimension (``[G, N / per_word]``).
Weight ``W[n, k]`` is then ``scales[g, n] * (q[k, n] - zeros[g, n])`` with
``g = g_idx[k]``: the torch path dequantises the whole ``[K, N]`` matrix on every
call and multiplies in the activations' dtype. It is the reference the faster
kernels are tested against, and the path every device can run.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 4, 8)  # the widths that fill an int32 word exactly


def values_per_word(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit packed weights: supported widths are {', '.join(map(str, SUPPORTED_BITS))}")
    return 32 // bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` int32 words -> ``[R * per_word, C]`` values (int32): word ``r`` holds
    rows ``r * per_word ... r * per_word + per_word - 1``, the first in its lowest bits."""
    per_word = values_per_word(bits)
    values = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, per_word, 1)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0] * per_word, packed.shape[1])


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` int32 words -> ``[R, C * per_word]`` values, packed along the columns."""
    per_word = values_per_word(bits)
    values = (packed.unsqueeze(2) >> _shifts(bits, packed.device).view(1, 1, per_word)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`unpack_rows` (``values`` in ``[0, 2**bits)``, rows a multiple of per_word)."""
    per_word = values_per_word(bits)
    grouped = values.to(torch.int64).reshape(-1, per_word, values.shape[1])
    words = (grouped << _shifts(bits, values.device).to(torch.int64).view(1, per_word, 1)).sum(dim=1)
    return _as_int32(words)


def pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`unpack_columns`."""
    per_word = values_per_word(bits)
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, per_word)
    words = (grouped << _shifts(bits, values.device).to(torch.int64).view(1, 1, per_word)).sum(dim=2)
    return _as_int32(words)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_grouped(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[K, N]`` weights ``scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n])`` (computed in
    float32, returned as ``dtype``); ``q`` ``[K, N]``, ``zeros`` and ``scales`` ``[G, N]``."""
    groups = g_idx.long()
    return ((q - zeros[groups]).float() * scales[groups].float()).to(dtype)


def gptq_dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A GPTQ layer's ``[K, N]`` weight from its packed ``qweight`` and unpacked ``zeros``."""
    return dequantize_grouped(unpack_rows(qweight, bits), zeros, scales, g_idx, dtype)


def dequantized_linear(x: torch.Tensor, weight_kn: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W + b`` for a ``[K, N]`` weight, in ``x``'s dtype."""
    out = x @ weight_kn
    return out if bias is None else out + bias.to(out.dtype)
