"""Triton kernels for GPUs: ``x @ W.T`` with ``W`` still in its GGUF blocks, dequantised in registers.

The weight is the uint8 ``[N, bytes per row]`` block tensor the CPU path keeps (the layouts are in
:mod:`tokenmill_quant_gguf.blocks` and :mod:`tokenmill_quant_gguf.kquants`). Each program computes a
``BLOCK_M x BLOCK_N`` tile of the output; its K loop takes 32 input values a step, which is one
block of the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and one 32-value sub-block of a K-quant
super-block (Q4_K, Q5_K, Q6_K). A step loads the tile's bytes for its ``BLOCK_N`` weight rows, reads
the float16 scales out of them with bitcasts and the quants with shifts and masks, forms the float32
``[32, BLOCK_N]`` slice of ``W.T`` and adds its ``tl.dot`` with the activations into a float32
accumulator. No float copy of the weight is written to memory: decode reads each block once a step.
At decode's few rows the output tiles are too few to occupy a GPU, so several programs share a tile's
K loop, each summing its run of steps into a partial tile, and the partials are added after in a
fixed order (:func:`k_splits`; deterministic, unlike atomic adds).
The embedding lookup (:func:`gguf_embedding_triton`) runs the same block readers on the table rows
the ids name, one launch for them all.

The arithmetic of a value is the torch reference's (:func:`~tokenmill_quant_gguf.blocks.dequantize_rows`)
step for step, so only the matmul's summation order differs from it. Tested against that reference
on the CPU under ``TRITON_INTERPRET=1`` and on CUDA where a GPU is lent (``-m gpu``).
Importing this module imports triton: only the GPU path and its tests do.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from tokenmill_quant_gguf.blocks import block_geometry

# The types this kernel reads; its branches test ggml's type numbers (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7,
# Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14), the kernel's QTYPE.
TRITON_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                          GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                          GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K})
BLOCK_M, BLOCK_N = 16, 32  # tl.dot wants every side >= 16


@triton.jit
def _byte(block_ptr, offset):
    """Byte ``offset`` (a tensor broadcasting against ``block_ptr``) of each weight row's block, as int32."""
    return tl.load(block_ptr + offset).to(tl.int32)


@triton.jit
def _half(block_ptr, offset):
    """The little-endian float16 at ``offset`` of each block, as float32."""
    bits = tl.load(block_ptr + offset).to(tl.uint16) | (tl.load(block_ptr + offset + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _legacy_block(block_ptr, j, QTYPE: tl.constexpr):
    """Values ``j`` (``[32, 1]``) of one legacy block per row (``block_ptr``: ``[1, BLOCK_N]``)."""
    d = _half(block_ptr, 0)
    if QTYPE == 8:  # Q8_0: d, then 32 int8 quants
        value = d * tl.load(block_ptr + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
    else:  # d (and m for Q4_1, Q5_1), the 5-bit types' 32-bit qh, then 16 bytes of nibbles
        with_min: tl.constexpr = (QTYPE == 3) | (QTYPE == 7)
        five_bit: tl.constexpr = (QTYPE == 6) | (QTYPE == 7)
        high_start: tl.constexpr = 4 if with_min else 2
        nibbles_start: tl.constexpr = high_start + 4 if five_bit else high_start
        q = (_byte(block_ptr, nibbles_start + j % 16) >> (j // 16 * 4)) & 0x0F
        if five_bit:  # bit j of the little-endian qh
            q = q | (((_byte(block_ptr, high_start + j // 8) >> (j % 8)) & 1) << 4)
        if with_min:
            value = d * q.to(tl.float32) + _half(block_ptr, 2)
        else:
            value = d * (q - (16 if five_bit else 8)).to(tl.float32)
    return value


@triton.jit
def _k_quant_sub_block(block_ptr, sub, j, QTYPE: tl.constexpr):
    """Values ``j`` (``[32, 1]``) of sub-block ``sub`` (0-7) of one K-quant super-block per row."""
    if QTYPE == 14:  # Q6_K: ql[128], qh[64], 16 int8 scales (one per 16 values), d
        index = sub * 32 + j
        half, within = index // 128, index % 128
        low = (_byte(block_ptr, half * 64 + within % 64) >> (within // 64 * 4)) & 0x0F
        high = (_byte(block_ptr, 128 + half * 32 + within % 32) >> (within // 32 * 2)) & 0x03
        scale = _half(block_ptr, 208) * tl.load(block_ptr + 192 + index // 16).to(tl.int8, bitcast=True).to(tl.float32)
        value = scale * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: qh[32]), nibbles[128]
        # Scales and mins 0-3: the low 6 bits of bytes 4-7 and 8-11; 4-7: the nibbles of bytes 12-15
        # below the top 2 bits of bytes 4-7 and 8-11.
        upper = sub >= 4
        first = sub % 4
        scale_byte, min_byte, low_byte = _byte(block_ptr, 4 + first), _byte(block_ptr, 8 + first), \
            _byte(block_ptr, 12 + first)
        scale = tl.where(upper, (low_byte & 0x0F) | ((scale_byte >> 2) & 0x30), scale_byte & 0x3F)
        minimum = tl.where(upper, (low_byte >> 4) | ((min_byte >> 2) & 0x30), min_byte & 0x3F)
        nibbles_start: tl.constexpr = 48 if QTYPE == 13 else 16
        q = (_byte(block_ptr, nibbles_start + sub // 2 * 32 + j) >> (sub % 2 * 4)) & 0x0F
        if QTYPE == 13:  # bit `sub` of qh[j]
            q = q | (((_byte(block_ptr, 16 + j) >> sub) & 1) << 4)
        value = _half(block_ptr, 0) * scale.to(tl.float32) * q.to(tl.float32) - \
            _half(block_ptr, 2) * minimum.to(tl.float32)
    return value


@triton.jit
def _gguf_matmul(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os, steps_per_split,
                 QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``(i, j, s)``: output tile ``(i, j)``'s sum over split ``s`` of the K steps, into ``out[s]``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(2) * steps_per_split
    # Past N, read row 0's bytes (always there) rather than mask every load; those columns are not stored.
    weight_rows = w_ptr + tl.where(cols < N, cols, 0).to(tl.int64)[None, :] * stride_wn
    j = tl.arange(0, 32)[:, None]
    k_quant: tl.constexpr = QTYPE >= 12
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, tl.minimum(first + steps_per_split, K // 32)):
        x = tl.load(x_ptr + rows[:, None] * stride_xm + step * 32 + tl.arange(0, 32)[None, :], mask=rows[:, None] < M,
                    other=0.0).to(tl.float32)
        if k_quant:
            weight = _k_quant_sub_block(weight_rows + step // 8 * BLOCK_BYTES, step % 8, j, QTYPE)
        else:
            weight = _legacy_block(weight_rows + step * BLOCK_BYTES, j, QTYPE)
        acc += tl.dot(x, weight, input_precision="ieee")
    tl.store(out_ptr + tl.program_id(2) * stride_os + rows[:, None] * stride_om + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def gguf_linear_triton(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                       bias: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """``x [..., in_features] @ dequantize(qweight).T + bias`` for block rows ``qweight`` (uint8 ``[N, bytes]``,
    rows contiguous) of a type in :data:`TRITON_TYPES`; float32 accumulation, the result in ``x``'s dtype.
    ``splits``: how many programs share each output tile's K loop (default :func:`k_splits`)."""
    flat = x.reshape(-1, in_features).contiguous()
    m, n, steps = flat.shape[0], qweight.shape[0], in_features // 32
    splits = splits or k_splits(m, n, steps, x.device)
    per_split = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, per_split)  # none left without steps
    out = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)
    _gguf_matmul[grid](flat, qweight, out, m, n, in_features, flat.stride(0), qweight.stride(0), out.stride(1),
                       out.stride(0), per_split, QTYPE=int(qtype), BLOCK_BYTES=block_geometry(qtype)[1],
                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    out = out[0] if splits == 1 else out.sum(0)  # the partial sums in a fixed order: the same result every run
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def k_splits(m: int, n: int, steps: int, device: torch.device) -> int:
    """How many programs share a tile's K loop: at decode's few rows the output tiles alone are too few to
    keep every streaming multiprocessor reading blocks (4096 outputs are 128 tiles), so the K loop is split
    until there are about four programs per multiprocessor, each keeping 8 or more of its 32-value steps;
    where the tiles are enough (prefill, a vocabulary-wide lm_head) it is not split."""
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    wanted = 4 * _multiprocessors(device)
    return max(1, min(triton.cdiv(wanted, tiles), steps // 8))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@triton.jit
def _gguf_rows(w_ptr, ids_ptr, out_ptr, R, stride_wn, stride_or,
               QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program ``(i, step)``: values ``32 * step ..`` of the table rows named by ids ``BLOCK_R * i ..``."""
    lookups = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ids = tl.load(ids_ptr + lookups, mask=lookups < R, other=0)
    step = tl.program_id(1)
    table_rows = w_ptr + ids.to(tl.int64)[None, :] * stride_wn  # the ids play the matmul's output columns
    j = tl.arange(0, 32)[:, None]
    if QTYPE >= 12:
        values = _k_quant_sub_block(table_rows + step // 8 * BLOCK_BYTES, step % 8, j, QTYPE)
    else:
        values = _legacy_block(table_rows + step * BLOCK_BYTES, j, QTYPE)
    tl.store(out_ptr + lookups[None, :].to(tl.int64) * stride_or + step * 32 + j, values,
             mask=(lookups < R)[None, :])


def gguf_embedding_triton(qweight: torch.Tensor, ids: torch.Tensor, qtype: GGMLQuantizationType,
                          dim: int) -> torch.Tensor:
    """The float32 rows ``[len(ids), dim]`` of the block table ``qweight`` that 1-d ``ids`` name, each
    dequantised once in registers by the matmul's block readers: the values the reference gives, bit for bit."""
    out = torch.empty(ids.shape[0], dim, device=qweight.device, dtype=torch.float32)
    if ids.shape[0] == 0:
        return out
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    grid = (triton.cdiv(ids.shape[0], BLOCK_N), dim // 32)
    _gguf_rows[grid](qweight, ids.contiguous(), out, ids.shape[0], qweight.stride(0), out.stride(0),
                     QTYPE=int(qtype), BLOCK_BYTES=block_geometry(qtype)[1], BLOCK_R=BLOCK_N,
                     enable_fp_fusion=False)  # no fused multiply-adds: bit for bit the reference's values
    return out
