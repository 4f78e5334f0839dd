"""A small quantizer into the K-quant layouts, for tests: the ``gguf`` package dequantises
Q4_K/Q5_K/Q6_K but does not quantize them (its ``quantize`` raises NotImplementedError).

It packs the documented block layouts (``ggml-common.h``: the field order, the 6-bit
scale/min packing of Q4_K/Q5_K, Q6_K's ql/qh split) with plain round-to-nearest
scales, not llama.cpp's error-minimising search: the bytes are real blocks, only
the choice of scales is simpler. Packing is checked by the ``gguf`` package's
dequantiser: its values come back within a quantization step of the input
(``test_gguf_kquants``), and any byte in a wrong place would not.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

Q4_K, Q5_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K


def quantize_k(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float ``[rows, K]`` (K a multiple of 256) as uint8 block rows of ``qtype``."""
    blocks = values.astype(np.float32).reshape(-1, 256)
    packed = _q6_k(blocks) if qtype == Q6_K else _q45_k(blocks, 4 if qtype == Q4_K else 5)
    return packed.reshape(values.shape[0], -1)


def random_k_blocks(rows: int, k: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random bytes in ``qtype``'s layout with finite float16 scales: every integer field
    (quants, 6-bit scales and mins, high bits) takes arbitrary values, as real files do."""
    rng = np.random.default_rng(seed)
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, (rows * k // 256, size), dtype=np.uint8)
    halves = (rng.standard_normal((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == Q6_K:
        blocks[:, 208:210] = halves[:, 0:2]
    else:
        blocks[:, 0:4] = halves
    return blocks.reshape(rows, -1)


def _q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)  # value = d * sc * q - dmin * m, with m >= 0
    step = (sub.max(axis=-1) - low) / (2**bits - 1)
    d, sc = _six_bit(step)
    dmin, m = _six_bit(-low)
    scale = (d[:, None] * sc).astype(np.float32)
    offset = (dmin[:, None] * m).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, np.rint((sub + offset[..., None]) / scale[..., None]), 0)
    q = np.clip(q, 0, 2**bits - 1).astype(np.uint8)
    scales = np.empty((blocks.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    pairs = q.reshape(-1, 4, 2, 32)
    nibbles = ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    parts = [_half(d), _half(dmin), scales]
    if bits == 5:
        high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(np.bitwise_or.reduce(high, axis=1).astype(np.uint8))
    return np.concatenate([*parts, nibbles], axis=-1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    d = (amax.max(axis=-1) / (31 * 127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(amax / 31 / d[:, None]), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    scale = (d[:, None] * sc.astype(np.float32)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, np.rint(sub / scale[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, i, l]
    ql = np.empty((blocks.shape[0], 2, 64), dtype=np.uint8)
    ql[:, :, 0:32] = (q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4)
    ql[:, :, 32:64] = (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([ql.reshape(-1, 128), qh.astype(np.uint8).reshape(-1, 64), sc.view(np.uint8),
                           _half(d)], axis=-1)


def _six_bit(step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float16 super-scale and eight 6-bit multiples of it approximating ``step`` ``[n, 8]``."""
    d = (step.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        multiples = np.where(d[:, None] > 0, np.ceil(step / d[:, None]), 0)
    return d, np.clip(multiples, 0, 63).astype(np.uint8)


def _half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)
