"""A Triton kernel for GPUs: the packed int weight dequantised in registers inside the matmul.

Each program computes a ``BLOCK_M x BLOCK_N`` tile of ``x @ W``: for every
``BLOCK_K`` slice of the input it loads the packed ``qweight`` words of that slice
(each word serving ``32 / bits`` consecutive input rows), shifts and masks out the
rows' values, subtracts the zeros and multiplies by the scales of each row's group
(``g_idx``: act-order included), and accumulates the tile's dot product in
float32. The full ``[K, N]`` float weight is never written to memory, which is the
point on a GPU: decode reads each packed weight once per step.

It is tested against the torch path (:func:`~tokenmill_quant_gptq.kernels.gptq_dequantize`)
on the CPU under ``TRITON_INTERPRET=1`` and on CUDA where a GPU is lent (``-m gpu``).
Importing this module imports triton: only the GPU path and its tests do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # tl.dot wants every side >= 16


@triton.jit
def _packed_int_matmul(x_ptr, qweight_ptr, zeros_ptr, scales_ptr, g_idx_ptr, out_ptr, M, N, K,
                       stride_xm, stride_qk, stride_zg, stride_sg, stride_om,
                       BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    per_word: tl.constexpr = 32 // BITS
    mask_bits: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        in_k = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & in_k[None, :],
                    other=0.0).to(tl.float32)
        tile_mask = in_k[:, None] & (cols[None, :] < N)
        words = tl.load(qweight_ptr + (ks // per_word)[:, None] * stride_qk + cols[None, :], mask=tile_mask, other=0)
        q = (words >> ((ks % per_word) * BITS)[:, None]) & mask_bits
        groups = tl.load(g_idx_ptr + ks, mask=in_k, other=0)
        zeros = tl.load(zeros_ptr + groups[:, None] * stride_zg + cols[None, :], mask=tile_mask, other=0)
        scales = tl.load(scales_ptr + groups[:, None] * stride_sg + cols[None, :], mask=tile_mask, other=0.0)
        weight = (q - zeros).to(tl.float32) * scales
        acc += tl.dot(x, weight, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def packed_int_linear_triton(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                             g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` for a GPTQ-packed ``qweight [K / p, N]``, unpacked ``zeros [G, N]``
    and ``scales [G, N]``; float32 accumulation, the result in ``x``'s dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    x, qweight, zeros = x.contiguous(), qweight.contiguous(), zeros.to(torch.int32).contiguous()
    scales, g_idx = scales.float().contiguous(), g_idx.to(torch.int32).contiguous()
    out = torch.empty(m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _packed_int_matmul[grid](x, qweight, zeros, scales, g_idx, out, m, n, k, x.stride(0), qweight.stride(0),
                             zeros.stride(0), scales.stride(0), out.stride(0),
                             BITS=bits, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
