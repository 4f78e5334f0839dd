"""ggml's quantized blocks as torch sees them, and the torch reference that dequantises them.

A quantized GGUF tensor of shape ``[rows, K]`` is stored row by row, each row a run
of blocks of ``block_size`` consecutive input values (32 for the legacy types, 256
for the K-quants). We keep those bytes as they are: a uint8 tensor ``[rows,
K // block_size * type_size]``. The three legacy layouts this file dequantises in
torch (and the CPU kernel in registers), one block each:

- ``Q4_0`` (18 bytes): float16 ``d``, then 16 bytes of 4-bit ``q``: value ``d * (q - 8)``;
- ``Q4_1`` (20 bytes): float16 ``d`` and ``m``, then 16 bytes of 4-bit ``q``: ``d * q + m``;
- ``Q8_0`` (34 bytes): float16 ``d``, then 32 int8 ``q``: ``d * q``;
- ``Q5_0`` (22 bytes): float16 ``d``, 4 bytes ``qh``, 16 bytes of nibbles: ``d * (q - 16)``;
- ``Q5_1`` (24 bytes): float16 ``d`` and ``m``, 4 bytes ``qh``, 16 bytes of nibbles: ``d * q + m``.

In the 4- and 5-bit types byte ``j`` holds value ``j`` in its low nibble and value ``j + 16``
in its high one; in the 5-bit types bit ``j`` of the little-endian 32-bit ``qh`` is
value ``j``'s fifth bit. The K-quants (Q4_K, Q5_K, Q6_K) are in
:mod:`tokenmill_quant_gguf.kquants`. Every other type is dequantised by the ``gguf``
package (numpy, on the CPU): the reference this module is tested against.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill_quant_gguf.kquants import K_QUANTS, dequantize_k_blocks

Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
Q5_0, Q5_1 = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1
# The types a linear layer keeps quantized in memory: the kernel and the torch reference both read them.
KEPT_QUANTIZED = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0}) | K_QUANTS
# Types that are plain numbers, not blocks: a GGUF stores small or unquantized tensors so.
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def block_geometry(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """``(values per block, bytes per block)`` of ``qtype``."""
    return GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values; ``ValueError`` where the blocks do not tile it."""
    size, nbytes = block_geometry(qtype)
    if in_features % size:
        raise ValueError(f"{in_features} input features are not a whole number of {qtype.name} blocks "
                         f"of {size} values")
    return in_features // size * nbytes


def dequantize_rows(qweight: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """The float32 ``[rows, in_features]`` values of block rows ``qweight`` (uint8 ``[rows, bytes]``),
    in torch on ``qweight``'s device for the kept types, by the ``gguf`` package for the others."""
    if qtype not in KEPT_QUANTIZED:
        unpacked = dequantize(qweight.cpu().numpy(), qtype).reshape(qweight.shape[0], in_features)
        return torch.from_numpy(np.ascontiguousarray(unpacked, dtype=np.float32)).to(qweight.device)
    nbytes = block_geometry(qtype)[1]
    if qtype in K_QUANTS:
        return dequantize_k_blocks(qweight.reshape(-1, nbytes), qtype).reshape(qweight.shape[0], in_features)
    blocks = qweight.reshape(qweight.shape[0], -1, nbytes)
    scale = _float16(blocks[..., 0:2])
    if qtype == Q8_0:
        quants = blocks[..., 2:].contiguous().view(torch.int8).float()
        values = scale * quants
    elif qtype in (Q5_0, Q5_1):
        values = _five_bit(blocks, scale, qtype)
    else:
        packed = blocks[..., 4:] if qtype == Q4_1 else blocks[..., 2:]
        quants = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        values = scale * quants + _float16(blocks[..., 2:4]) if qtype == Q4_1 else scale * (quants - 8)
    return values.reshape(qweight.shape[0], in_features)


def _five_bit(blocks: torch.Tensor, scale: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Q5_0 / Q5_1 block values ``[rows, blocks, 32]``: nibbles plus ``qh``'s fifth bits."""
    start = 4 if qtype == Q5_1 else 2
    high = blocks[..., start:start + 4].to(torch.int64)  # qh as a little-endian 32-bit word
    word = high[..., 0] | high[..., 1] << 8 | high[..., 2] << 16 | high[..., 3] << 24
    fifth = (word.unsqueeze(-1) >> torch.arange(32, device=blocks.device)) & 1
    packed = blocks[..., start + 4:]
    quants = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int64) | (fifth << 4)
    if qtype == Q5_0:
        return scale * (quants - 16).float()
    return scale * quants.float() + _float16(blocks[..., 2:4])


def _float16(two_bytes: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` little-endian bytes as a float32 ``[..., 1]`` (the block's float16 field)."""
    return two_bytes.contiguous().view(torch.float16).float()
