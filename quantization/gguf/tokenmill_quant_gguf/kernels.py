"""``x @ W.T`` with ``W`` still in GGUF blocks: the CPU kernel, or the torch reference.

The CPU kernel (:mod:`tokenmill_quant_gguf.cpu_kernel`, C++ built on first use)
dequantises each block in registers inside the dot products, so a decode step reads
the weight's 4.5 to 8.5 bits per value once and never writes a float copy. The
reference dequantises the block rows in torch (:func:`~tokenmill_quant_gguf.blocks.dequantize_rows`)
and multiplies by the float matrix: it runs on every device, and is what the kernel
is tested against. Which one a device gets is logged once.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, dequantize_rows

logger = logging.getLogger(__name__)


def gguf_linear_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise the rows to float32, then ``F.linear`` in float32; the result in ``x``'s dtype."""
    weight = dequantize_rows(qweight, qtype, in_features)
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(qweight).T + bias`` for ``x`` ``[..., in_features]``, by the fastest path here."""
    kernel = _cpu_kernel() if x.device.type == "cpu" and qtype in KEPT_QUANTIZED else None
    if kernel is None:
        _chosen(x.device.type, "the torch reference (dequantise the rows, then matmul)")
        return gguf_linear_reference(x, qweight, qtype, in_features, bias)
    _chosen(x.device.type, f"the C++ kernel ({kernel.isa()})")
    flat = x.reshape(-1, in_features).float().contiguous()
    out = torch.ops.tokenmill_gguf.matmul(flat, qweight, int(qtype), in_features)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


@functools.cache
def _cpu_kernel():  # type: ignore[no-untyped-def]  # a compiled module
    """The compiled kernel, its matmul registered as the torch op ``tokenmill_gguf::matmul``.

    Called through torch's dispatcher, the kernel is seen by torch function modes: the
    CPU platform's step-graph capture, which replays only the calls it records, meets
    an op it does not know and runs those steps eagerly, instead of replaying a decode
    step without its matmuls."""
    from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel

    kernel = load_cpu_kernel()
    if kernel is not None:
        @torch.library.custom_op("tokenmill_gguf::matmul", mutates_args=(), device_types="cpu")
        def matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
            return kernel.gguf_matmul(x, qweight, qtype, in_features)

        matmul.register_fake(lambda x, qweight, qtype, in_features: x.new_empty(x.shape[0], qweight.shape[0]))
    return kernel


@functools.cache
def _chosen(device: str, path: str) -> None:
    logger.info("GGUF quantized linear layers on %s: %s", device, path)
