"""The K-quant super-blocks (256 values each) as torch sees them, and their torch reference.

llama.cpp's K-quants split a super-block of 256 values into sub-blocks, each with a
small integer scale (and, for Q4_K/Q5_K, a minimum) multiplied by the super-block's
float16 scale(s). Layouts, little-endian and packed, as ``ggml-common.h`` declares them:

- ``Q4_K`` (144 bytes): f16 ``d``, f16 ``dmin``, 12 bytes of eight 6-bit scales and
  eight 6-bit mins, 128 bytes of 4-bit ``q``. Sub-block ``j`` (32 values) reads the
  low nibbles of bytes ``32 * (j // 2) ..`` for even ``j``, the high ones for odd ``j``:
  value ``d * sc[j] * q - dmin * m[j]``;
- ``Q5_K`` (176 bytes): as Q4_K, then 32 bytes ``qh`` before the nibbles: bit ``j`` of
  ``qh[l]`` is the fifth bit of value ``l`` of sub-block ``j``;
- ``Q6_K`` (210 bytes): 128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2 bits),
  16 int8 scales (one per 16 values), f16 ``d``; each half of 128 values reads 64
  bytes of ``ql`` and 32 of ``qh``: value ``d * scale * (q - 32)``.

The operations follow the ``gguf`` package's numpy dequantiser step for step in
float32, so the two agree bit for bit (the test checks it).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

Q4_K, Q5_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K
K_QUANTS = frozenset({Q4_K, Q5_K, Q6_K})
SUPER_BLOCK = 256


def dequantize_k_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Float32 ``[n, 256]`` values of ``n`` super-blocks (uint8 ``[n, bytes per block]``)."""
    if qtype == Q6_K:
        return _q6_k(blocks)
    d, dmin = _float16(blocks[:, 0:2]), _float16(blocks[:, 2:4])
    scales, mins = _scales_and_mins(blocks[:, 4:16])
    scale = (d * scales.float()).unsqueeze(-1)  # [n, 8, 1]
    offset = (dmin * mins.float()).unsqueeze(-1)
    if qtype == Q4_K:
        quants = _nibbles_per_sub_block(blocks[:, 16:144])
    else:
        high_bits = blocks[:, 16:48].unsqueeze(1) >> _shifts(8, 1, blocks.device)  # [n, 8, 32]
        quants = _nibbles_per_sub_block(blocks[:, 48:176]) | ((high_bits & 1) << 4)
    return (scale * quants.float() - offset).reshape(-1, SUPER_BLOCK)


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of Q4_K/Q5_K's 12 bytes: bytes 0-3 hold scales 0-3
    in their low 6 bits (and the top bits of scales 4-7 above), 4-7 the mins likewise,
    8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    d, m, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _nibbles_per_sub_block(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of nibbles as ``[n, 8, 32]``: sub-block ``2i`` the low nibbles of bytes
    ``32i .. 32i + 31``, sub-block ``2i + 1`` their high nibbles."""
    chunks = qs.reshape(-1, 4, 1, 32) >> _shifts(2, 4, qs.device).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 8, 32)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _float16(blocks[:, 208:210])
    scale = (d * scales).reshape(-1, 16, 1)
    low = (ql.reshape(-1, 2, 1, 64) >> _shifts(2, 4, blocks.device).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> _shifts(4, 2, blocks.device).reshape(1, 1, 4, 1)) & 0x03
    quants = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).to(torch.int8) - 32
    return (scale * quants.reshape(-1, 16, 16).float()).reshape(-1, SUPER_BLOCK)


def _shifts(count: int, step: int, device: torch.device) -> torch.Tensor:
    """``[count, 1]`` uint8 shift amounts ``0, step, 2 * step, ..``."""
    return (torch.arange(count, device=device, dtype=torch.uint8) * step).reshape(count, 1)


def _float16(two_bytes: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` little-endian bytes as float32 ``[n, 1]``."""
    return two_bytes.contiguous().view(torch.float16).float()
