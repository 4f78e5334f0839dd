"""The FP8 weight-only CPU kernel (``csrc/fp8_linear.cpp``): built on first use, chosen per layer.

Without FP8 dot products on this CPU, ``torch._scaled_mm`` (and the reference that dequantises
every call) widen the whole weight on every forward. The kernel instead reads the checkpoint's
own ``[N, K]`` float8 bytes, widens 16 (AVX2: 8) at a time in registers (e4m3 through float16
and ``vcvtph2ps``, e5m2 as float16's high byte) and multiplies them with float32 activations: the
weight stays one byte a value and nothing the size of the weight is written per call.

Activations are not quantized on this path (weight-only): quantizing them to e4m3 would only
round them (3 mantissa bits) with nothing to gain, there being no FP8 dot product to feed, so
the output is the dequantised weight's product with the unrounded input, up to float32
summation order. A static ``input_scale`` is read (and checked) but not applied here.

The weight scales reach the kernel as ``[N, G]`` float32, one per output row and group of
``group_size`` inputs: per tensor and per channel ``G = 1`` (``group_size = K``), block-wise one
per block column (``group_size`` the block's columns, each row its row block's scale).

The kernel lives in this plugin rather than in core: the compressed-tensors float-quantized
scheme is handed to this method (``tokenmill_quant_compressed_tensors.schemes``), so one kernel
serves both without a second plugin importing it. It is a torch op,
``torch.ops.tokenmill_fp8.fp8_linear``, with an ``.out`` overload that the CPU platform's step
graphs record.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.plugin_api import optional_native_extension

logger = logging.getLogger(__name__)
MODULE_NAME = "tokenmill_fp8_kernel"
SOURCE = Path(__file__).with_name("csrc") / "fp8_linear.cpp"
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512"]
KERNEL_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_NAN = 0x7F  # e4m3fn's NaN codes: s.1111.111 (it has no inf)


@functools.cache
def load_fp8_cpu_kernel() -> ModuleType | None:
    """The compiled module where it runs here (built first if need be), else None; logged once.
    Loading it registers ``torch.ops.tokenmill_fp8.fp8_linear`` (and a shape-only form for
    torch's tracers)."""
    module = optional_native_extension(MODULE_NAME, "fp8", [SOURCE], CFLAGS, "FP8 weight-only CPU kernel",
                                       fallback="the torch path (torch._scaled_mm or the reference)",
                                       needs="AVX-512 F/BW/VL or AVX2 with F16C")
    if module is not None:
        torch.library.register_fake("tokenmill_fp8::fp8_linear")(_fake_fp8_linear)
    return module


def _fake_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def cpu_kernel_refusal(weight: torch.Tensor) -> str | None:
    """Why the kernel cannot take this layer's fp8 ``weight`` (None: it can)."""
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type}"
    if weight.dtype not in KERNEL_DTYPES:
        return f"{weight.dtype} weights"
    if weight.dtype == torch.float8_e4m3fn and bool(((weight.view(torch.uint8) & 0x7F) == E4M3_NAN).any()):
        return "the weight holds NaN codes, which the kernel's widening does not keep"  # (checked once, here)
    if load_fp8_cpu_kernel() is None:
        return "the kernel does not run here (see the log line above)"
    return None


def choose_cpu_kernel(weight: torch.Tensor, kind: str) -> bool:
    """Whether this layer runs the kernel, logged once per kind (``"fp8"``, ``"block-wise fp8"``)
    and outcome; only CPU layers ask."""
    reason = cpu_kernel_refusal(weight)
    if reason is None:
        _chosen(kind, "the weight-only CPU kernel (fp8 widened in registers; activations not quantized)")
        return True
    _chosen(kind, f"not the weight-only CPU kernel ({reason})")
    return False


@functools.cache
def _chosen(kind: str, path: str) -> None:
    logger.info("%s linear layers on cpu: %s", kind, path)


def fp8_cpu_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (fp8 weight * scales).T (+ bias)`` by the kernel, for a 2-d ``x``, in ``x``'s dtype
    (``scales`` float32 ``[N, ceil(K / group_size)]``, ``bias`` float32 or None)."""
    if load_fp8_cpu_kernel() is None:  # (cached) loading the kernel registers its op
        raise RuntimeError("the FP8 CPU kernel does not run here (neither AVX-512 F/BW/VL nor AVX2, or no compiler)")
    return torch.ops.tokenmill_fp8.fp8_linear(x.contiguous(), weight, scales, group_size, bias)


def fp8_weight_only_reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int,
                              bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in torch: the weight dequantised to float32, then a float32 matmul."""
    full = scales.float().repeat_interleave(group_size, dim=1)[:, :weight.shape[1]]
    out = x.float() @ (weight.float() * full).t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def kernel_scales_per_channel(weight_scale: torch.Tensor) -> torch.Tensor:
    """The method's per-channel ``[N]`` scales as the kernel's ``[N, 1]``."""
    return weight_scale.float().reshape(-1, 1).contiguous()


def kernel_scales_per_block(weight_scale_inv: torch.Tensor, rows: int, out_features: int) -> torch.Tensor:
    """Block scales ``[ceil(N / rows), G]`` as the kernel's ``[N, G]`` (each row its row block's)."""
    return weight_scale_inv.float().repeat_interleave(rows, dim=0)[:out_features].contiguous()


def kernel_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The layer's bias as the kernel's float32, converted once at load (a step graph's capture
    would refuse a conversion in every call)."""
    return None if bias is None else bias.detach().float().contiguous()
