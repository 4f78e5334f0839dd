"""INT8 W8A8: symmetric quantization and the int8 matmul, ``torch._int_mm`` and its reference,
and the CPU's fused kernel.

Activations are quantized per token (``scale = max|x_row| / 127``), weights per
output channel; ``x @ W.T`` is then ``(xq @ wq.T) * x_scale * w_scale``, the integer
product accumulated exactly in int32 by ``torch._int_mm``. The torch reference
computes the same integer product in float64 (exact: every partial sum is an
integer far below 2**53), so the two agree to the last bit before scaling.

On a CPU with AVX-512 VNNI or AVX2, :func:`w8a8_linear_cpu` runs the whole dynamic
symmetric layer (quantize the rows, the int8 product, the scaling) in one C++ call
(``csrc/w8a8_linear.cpp``, the AVX2 bodies in ``csrc/w8a8_avx2.h``), the same operations in
the same order, so its output is :func:`w8a8_linear_torch`'s bit for bit (VNNI: ``128 *
rowsum(W)`` taken out for its unsigned-by-signed products; AVX2: ``|w|`` times ``x`` with
``w``'s sign, pairs exact in int16). It reads the row-major int8 weight (:func:`w8a8_linear_cpu`) or the
panels a loaded layer keeps instead, packed once (:func:`w8a8_pack_panels_cpu`,
:func:`w8a8_linear_packed_cpu`).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

INT8_MAX = 127  # symmetric: -128 is never used, so negation cannot overflow
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round(x / scale)`` saturated to [-127, 127]."""
    return torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of a 2-d ``x``: ``(int8 [M, K], float32 scales [M, 1])``."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) / INT8_MAX
    return quantize_int8(x, scale), scale


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [N, K], float32 scales [N])``."""
    scale = weight.abs().amax(dim=1).float().clamp(min=_MIN_SCALE) / INT8_MAX
    return quantize_int8(weight, scale[:, None]), scale


def int8_matmul_reference(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``xq @ weight.T`` as int32, computed in float64."""
    return (xq.double() @ weight.double().t()).to(torch.int32)


def int8_matmul_int_mm(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``xq @ weight.T`` as int32 through ``torch._int_mm`` (``weight.t()`` is the
    column-major ``[K, N]`` view of the row-major ``[N, K]`` weight)."""
    return torch._int_mm(xq, weight.t())


def scale_output(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """The int32 product back to real units: ``acc * x_scale * weight_scale (+ bias)``."""
    out = acc.float() * x_scale * weight_scale.float()[None, :]
    return (out if bias is None else out + bias.float()).to(out_dtype)


@functools.cache
def int_mm_runs_on(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` at all (tried once on a small product)."""
    try:
        a = torch.zeros(32, 32, device=device, dtype=torch.int8)
        int8_matmul_int_mm(a, a)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def int_mm_takes(device: torch.device, m: int, k: int, n: int) -> bool:
    """Whether ``torch._int_mm`` takes an ``[m, k] x [k, n]`` product on ``device``. CUDA's
    wants ``m > 16`` and ``k``, ``n`` multiples of 8; the CPU's takes any shape."""
    if not int_mm_runs_on(device):
        return False
    return device.type != "cuda" or cuda_int_mm_takes(m, k, n)


def cuda_int_mm_takes(m: int, k: int, n: int) -> bool:
    """CUDA's ``torch._int_mm`` shape rule (cuBLASLt int8 GEMM)."""
    return m > 16 and k % 8 == 0 and n % 8 == 0


def int8_matmul(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``xq @ weight.T`` in int32 by ``torch._int_mm`` where it takes the shape, else the
    reference; each (device, path) choice logged once."""
    m, k = xq.shape
    n = weight.shape[0]
    if int_mm_takes(xq.device, m, k, n):
        _chosen(xq.device, "torch._int_mm")
        return int8_matmul_int_mm(xq, weight)
    _chosen(xq.device, "torch reference (torch._int_mm refuses the shape)")
    return int8_matmul_reference(xq, weight)


def chosen_path(device: torch.device, path: str) -> None:
    """Log, once per device and path, what runs the int8 W8A8 linear layers."""
    _chosen(device, path)


@functools.cache
def _chosen(device: torch.device, path: str) -> None:
    logger.info("int8 W8A8 linear layers on %s: %s", device, path)


def w8a8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """The dynamic symmetric W8A8 layer of a 2-d ``x`` in torch ops (what the fused kernel computes)."""
    xq, x_scale = quantize_per_token(x)
    return scale_output(int8_matmul(xq, weight), x_scale, weight_scale, bias, x.dtype)


def w8a8_linear_cpu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_row_sum: torch.Tensor,
                    bias: torch.Tensor | None, product: str = "auto") -> torch.Tensor:
    """:func:`w8a8_linear_torch` in one call of the CPU kernel (where :func:`cpu_kernel_runs`);
    ``weight_row_sum``: ``weight.sum(dim=1)`` in int32, kept with the layer. ``product``: how the
    kernel multiplies, ``"tiles"`` (its own VNNI loops over the weight as stored: few rows; not in
    the AVX2 build),
    ``"int_mm"`` (``torch._int_mm``, then its own scaling pass: many rows), ``"panels"`` (its own
    tiles over weight panels it packs per call: many rows) or ``"auto"`` (VNNI: tiles below 8
    rows, panels from there on; AVX2: panels); all give the same bits."""
    if not cpu_kernel_runs():  # (cached) loading the kernel registers its op
        raise RuntimeError("the int8 W8A8 CPU kernel does not run here (neither AVX-512 VNNI nor AVX2, or no compiler)")
    return torch.ops.tokenmill_int8.w8a8_linear(x.contiguous(), weight, weight_scale, weight_row_sum,
                                                None if bias is None else bias.float().contiguous(), product)


def w8a8_pack_panels_cpu(weight: torch.Tensor) -> torch.Tensor:
    """A row-major int8 ``[N, K]`` weight packed once (at load) into the panels the CPU kernel
    multiplies by: int8 ``[ceil(N / 64), ceil(K / 64) * 16, 4, 64]``, the weight's own bytes
    reordered and padded to whole panels. The layer then keeps these instead of the weight (see
    :func:`w8a8_linear_packed_cpu`)."""
    if not cpu_kernel_runs():
        raise RuntimeError("the int8 W8A8 CPU kernel does not run here (neither AVX-512 VNNI nor AVX2, or no compiler)")
    return torch.ops.tokenmill_int8.w8a8_pack_panels(weight.contiguous())


def w8a8_linear_packed_cpu(x: torch.Tensor, panels: torch.Tensor, in_features: int, weight_scale: torch.Tensor,
                           weight_row_sum: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`w8a8_linear_cpu` over the panels :func:`w8a8_pack_panels_cpu` made (the same bits):
    every row count multiplies the panels as they lie, one stream through the weight's bytes
    read ahead of use, where the row-major weight's tiles read four rows at once and its
    panels pack the weight again in every call. ``in_features``: the weight's K (the panels hold
    it rounded up to 64); the outputs are ``weight_scale``'s."""
    return torch.ops.tokenmill_int8.w8a8_linear_packed(x.contiguous(), panels, in_features, weight_scale,
                                                       weight_row_sum, None if bias is None else bias.float().contiguous())


@functools.cache
def cpu_kernel_runs() -> bool:
    """Whether the fused CPU kernel is built for this CPU (AVX-512 VNNI or AVX2). Loading it registers
    its ops, ``torch.ops.tokenmill_int8.w8a8_linear``, ``w8a8_linear_packed`` and ``w8a8_pack_panels``,
    and the two products' out overloads ``w8a8_linear.out`` and ``w8a8_linear_packed.out`` (in
    C++: calls through torch's dispatcher, which torch function modes see; the CPU platform's
    step-graph capture records the call as one of the out overload, replayed from C++)."""
    from tokenmill_quant_int8.cpu_kernel import load_w8a8_kernel

    return load_w8a8_kernel() is not None
