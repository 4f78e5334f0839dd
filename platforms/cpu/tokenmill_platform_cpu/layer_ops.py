"""The CPU platform's layer ops: fused C++ kernels for the elementwise ops
(float32 and bfloat16), a C++ kernel for linear layers of one to three rows
(float32 and bfloat16), MKL's packed GEMM for larger float32 ones (larger
bfloat16 matmuls go to torch, which runs them on oneDNN, with AMX where the CPU
has it); anything else goes to the torch reference they are tested against.

Packed GEMM: MKL's ``sgemm`` repacks the weight matrix into its internal
layout on every call, which at decode batch sizes costs as much as the
multiplication. Packing each weight once after loading (``cblas_sgemm_pack``,
reached through torch's ``mkl::_mkl_linear`` ops) measured 1.5x (batch 64) to
2x (batch 16) faster over a whole layer stack. Below ``PACKED_MIN_ROWS`` rows
(matrix-vector products) and above ``PACKED_MAX_ROWS`` (prefill chunks) the
plain call is as fast or faster, so the unpacked weight is kept for those. The
packed copies take as much memory again as the weights they copy: the platform
bounds them (``TOKENMILL_PACKED_WEIGHTS``, default a quarter of available RAM).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from tokenmill.layers import NativeLayerOps

logger = logging.getLogger(__name__)

# The fused kernels' dtypes (bfloat16 is computed in float32 and rounded once).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PACKED_MIN_ROWS = 4
PACKED_MAX_ROWS = 512
# Matmuls of at most this many rows go to the C++ small-matmul kernel, which reads
# the weights faster than torch does: bfloat16 1.5-1.9x (one row) and 1.2-1.4x (two
# or three), float32 ~1.1x (one row; MKL's sgemv) and as fast (two or three).
SMALL_MAX_ROWS = 3
# The layout is packed for this many rows; MKL computes any row count from it
# (checked once per process by _packing_works).
_PACK_ROWS_HINT = 64


class CpuLayerOps(NativeLayerOps):
    """``packed_budget``: bytes the packed weight copies of the engine being built may
    take in all (each packed weight sits beside its plain one, so packing doubles a
    model's linear weights); weights past it stay unpacked. The platform makes a new
    instance, with a fresh budget, for each engine."""

    def __init__(self, kernels: ModuleType, packed_budget: int) -> None:
        self._kernels = kernels
        # the dtypes the small-matmul kernel has a vector body for in this build
        self._small_dtypes = {getattr(torch, name) for name in kernels.small_linear_dtypes()}
        self._packing: bool | None = None  # None: not checked yet
        self._packed_budget = packed_budget

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        if weight.dtype != torch.float32 or weight.dim() != 2 or not self._packing_available():
            return None
        size = weight.numel() * weight.element_size()
        if size > self._packed_budget:
            return None
        self._packed_budget -= size
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               prepared: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if 1 <= rows <= SMALL_MAX_ROWS and x.dtype == weight.dtype and x.dtype in self._small_dtypes:
            out = self._kernels.small_linear(x.reshape(rows, x.shape[-1]), weight, bias)
            return out.view(*x.shape[:-1], weight.shape[0])
        if prepared is None or x.dtype != torch.float32 or not PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS:
            return F.linear(x, weight, bias)
        # The last argument is the row count the packed path accepts: this call's.
        return torch.ops.mkl._mkl_linear(x, prepared, weight, bias, rows)

    def _packing_available(self) -> bool:
        if self._packing is None:
            self._packing = _packing_works()
            if not self._packing:
                logger.warning("MKL packed GEMM unavailable or inexact here; linear layers use plain matmuls")
        return self._packing

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps)
        return self._kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        if not _fused_add_applies(x, residual, weight):
            return super().add_rms_norm(x, residual, weight, eps)
        return self._kernels.add_rms_norm_(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES:
            return super().silu_and_mul(x)
        return self._kernels.silu_and_mul(x)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not _rotary_applies(q, k, cos_cache):
            return super().rotary(positions, q, k, cos_cache, sin_cache)
        self._kernels.rotary_embedding_(positions, q, k, cos_cache, sin_cache)
        return q, k


def _fused_add_applies(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype in KERNEL_DTYPES and x.dtype == residual.dtype == weight.dtype and x.is_contiguous()
            and residual.is_contiguous() and x.shape == residual.shape)


def _rotary_applies(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor) -> bool:
    return (q.dtype in KERNEL_DTYPES and q.dtype == k.dtype and cos_cache.dtype == torch.float32
            and q.dim() == k.dim() == 3 and q.stride(2) == 1 and k.stride(2) == 1 and q.shape[2] % 2 == 0)


@functools.cache  # the answer is the process's (its torch and MKL), not the engine's
def _packing_works() -> bool:
    """Packed GEMM exists (torch built with MKL) and gives F.linear's results at row
    counts other than the one the layout was packed for."""
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator)
    try:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_ROWS_HINT)
        for rows in (PACKED_MIN_ROWS, 37, _PACK_ROWS_HINT, PACKED_MAX_ROWS):
            x = torch.randn(rows, 80, generator=generator)
            got = torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
            if not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
                return False
    except RuntimeError:
        return False
    return True
