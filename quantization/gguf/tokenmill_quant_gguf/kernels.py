"""``x @ W.T`` with ``W`` still in GGUF blocks: the CPU kernel, the Triton kernel on CUDA, or the torch reference.

On a CUDA GPU with triton installed, :func:`gguf_linear` runs the Triton kernel
(:mod:`tokenmill_quant_gguf.triton_kernels`: every kept type, dequantised in registers inside a
float32 ``tl.dot`` matmul; :func:`gpu_kernel` says so once per type), and :func:`gguf_embedding` its
row lookup (the same block readers, one launch for the rows of every id).

The CPU kernel (:mod:`tokenmill_quant_gguf.cpu_kernel`, C++ built on first use) reads
the weight in its blocks, 4.5 to 8.5 bits per value, once per call and never writes a
float copy. How the activations meet it is the caller's choice (``activations``):

- ``"float32"``: as they are; each block is dequantised in registers into float32
  multiply-adds (the result is the dequantised float product up to summation order);
- ``"q8"``: quantised first, once per call, to 8-bit blocks of 32 with a float scale each
  (llama.cpp's Q8_0 of the activations), then integer dot products (AVX-512 VNNI) with
  the weights' quants, scaled per block: llama.cpp's numerics and speed;
- ``"q8x2"``, ``"q8x3"``: as ``"q8"`` plus a second (and third) 8-bit plane for the
  previous one's rounding error, about 15 (22) bits a value at one more integer product a
  plane; ``"q8x3"`` is within the float path's tolerance
  of transformers on the dequantised weights (``"q8x2"`` is not, on the tests' random tiny
  models, whose logprobs move by up to 0.06 with it);
- ``"auto"`` (what the GGUF methods use): ``"q8x3"`` for Q4_0/Q4_1/Q5_0/Q5_1, ``"float32"`` for
  the rest, whichever was faster at batch 1 (:data:`AUTO_ACTIVATIONS`).

The quantised forms exist for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 on a CPU with AVX-512
VNNI; other types and CPUs take the float path. From 32 rows of x on, every type and mode
dequantises panels of weight rows to float32 and multiplies them by torch's GEMM instead (faster
there, and the exact float product). ``kernel_path(type, activations, rows)`` says which loop
runs; it is logged once per type. The reference dequantises the block rows in
torch (:func:`~tokenmill_quant_gguf.blocks.dequantize_rows`) and multiplies by the float
matrix: it runs on every device, and is what the kernel is tested against.

The kernel is the torch op ``tokenmill_gguf::matmul`` (registered from C++ with an
``.out`` overload), called through ``torch.ops``, beside ``tokenmill_gguf::embedding`` (the
rows of a table kept in its blocks): torch function modes see it, and the
CPU platform's step-graph capture can record it.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, dequantize_rows

logger = logging.getLogger(__name__)
Activations = Literal["auto", "float32", "q8", "q8x2", "q8x3"]
# "auto", by block type: what ran fastest at batch 1 on the tiny Llama (quiet, AVX-512 VNNI; bench-quant,
# TPOT): Q4_0 4.39 ms with "q8x3" against 6.52 with "float32", Q8_0 7.24 with "float32" against 11.40 with
# "q8x3" (a Q8_0 block is as wide as its three planes, so the float FMAs read the same bytes and skip the
# quantisation). Both are within the float product's tolerance; types not named take "float32".
# With the scales gathered per tile (seventh session, scripts/bench-gguf-matmul.py, the tiny model's 33
# matmuls at M = 1, CPU time on a shared machine) one plane is only 10-20% faster than three (Q4_0 2.5 against
# 3.0 ms a sweep), not worth leaving the float tolerance for; Q8_0's planes now cost what its float path does
# at M = 1 (and 1.5x less from M = 4), so its batch-1 choice stays "float32". Eighth session (same script,
# one thread, CPU time, Q8_0 at M = 1, after the float loop's one-row form applies each block's scale after
# its products): float32 3.1-3.7 ms a sweep (0.65-0.70 of the read bound), one plane ("q8", llama.cpp's
# numerics) 5.3-6.6, three planes 5.4-6.4: one plane is no win for Q8_0 here either, so "auto" keeps "float32".
AUTO_ACTIVATIONS: dict[GGMLQuantizationType, Activations] = {
    GGMLQuantizationType.Q4_0: "q8x3", GGMLQuantizationType.Q4_1: "q8x3",
    GGMLQuantizationType.Q5_0: "q8x3", GGMLQuantizationType.Q5_1: "q8x3",
}


def resolved_activations(qtype: GGMLQuantizationType, activations: Activations) -> Activations:
    """The mode the kernel runs for ``activations`` ("auto": :data:`AUTO_ACTIVATIONS`)."""
    return AUTO_ACTIVATIONS.get(qtype, "float32") if activations == "auto" else activations


def gguf_linear_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise the rows to float32, then ``F.linear`` in float32; the result in ``x``'s dtype."""
    weight = dequantize_rows(qweight, qtype, in_features)
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                bias: torch.Tensor | None = None, activations: Activations = "float32") -> torch.Tensor:
    """``x @ dequantize(qweight).T + bias`` for ``x`` ``[..., in_features]``, by the fastest path here
    for ``activations`` (the Triton kernel on CUDA and the torch reference elsewhere are float32 whatever they say)."""
    if x.device.type == "cuda" and gpu_kernel(qtype) == "triton":
        from tokenmill_quant_gguf.triton_kernels import gguf_linear_triton

        return gguf_linear_triton(x, qweight, qtype, in_features, bias)
    kernel = _cpu_kernel() if x.device.type == "cpu" and qtype in KEPT_QUANTIZED else None
    if kernel is None:
        _chosen(x.device.type, "the torch reference (dequantise the rows, then matmul)")
        return gguf_linear_reference(x, qweight, qtype, in_features, bias)
    _chosen(x.device.type, f"the C++ kernel ({kernel.isa()})")
    activations = resolved_activations(qtype, activations)
    _chosen_path(kernel, qtype, activations)
    # Only what is needed: in a float32 model each of these is a no-op left out, so a step
    # graph's capture meets the op and views alone.
    flat = x.reshape(-1, in_features)
    if flat.dtype != torch.float32:
        flat = flat.float()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    out = torch.ops.tokenmill_gguf.matmul(flat, qweight, int(qtype), in_features, bias, activations)
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], qweight.shape[0])


def gguf_embedding(qweight: torch.Tensor, ids: torch.Tensor, qtype: GGMLQuantizationType, dim: int) -> torch.Tensor:
    """The float32 rows ``[len(ids), dim]`` of the block table ``qweight`` that 1-d ``ids`` name:
    the CPU kernel's op (which a step graph can record), the Triton kernel on CUDA, or the torch reference."""
    if qweight.device.type == "cuda" and gpu_kernel(qtype) == "triton":
        from tokenmill_quant_gguf.triton_kernels import gguf_embedding_triton

        return gguf_embedding_triton(qweight, ids, qtype, dim)
    kernel = _cpu_kernel() if qweight.device.type == "cpu" and qtype in KEPT_QUANTIZED else None
    if kernel is None:
        return dequantize_rows(qweight[ids], qtype, dim)
    return torch.ops.tokenmill_gguf.embedding(qweight, ids, int(qtype), dim)


@functools.cache
def gpu_kernel(qtype: GGMLQuantizationType) -> Literal["triton", "torch"]:
    """What multiplies ``qtype``'s blocks on a CUDA GPU: ``"triton"`` (the Triton kernel, which
    dequantises them in registers inside the matmul) where triton imports and the kernel reads the
    type, else ``"torch"`` (the reference); logged once per type with the reason."""
    kernel: Literal["triton", "torch"] = "torch"
    try:
        from tokenmill_quant_gguf.triton_kernels import TRITON_TYPES
    except ImportError:
        reason = "the torch reference: triton is not installed"
    else:
        if qtype in TRITON_TYPES:
            kernel, reason = "triton", "the Triton kernel (blocks dequantised in registers inside the matmul)"
        else:
            reason = "the torch reference: the Triton kernel does not read this type"
    logger.info("GGUF %s layers on cuda: %s", qtype.name, reason)
    return kernel


@functools.cache
def _cpu_kernel():  # type: ignore[no-untyped-def]  # a compiled module
    """The compiled kernel; loading it registers the torch op ``tokenmill_gguf::matmul``
    (and its ``.out`` overload), given a fake (shape-only) form here for torch's tracers."""
    from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel

    kernel = load_cpu_kernel()
    if kernel is not None:
        torch.library.register_fake("tokenmill_gguf::matmul")(_fake_matmul)
        torch.library.register_fake("tokenmill_gguf::embedding")(_fake_embedding)
    return kernel


def _fake_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: int, in_features: int,
                 bias: torch.Tensor | None = None, activations: str = "float32") -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


def _fake_embedding(qweight: torch.Tensor, ids: torch.Tensor, qtype: int, dim: int) -> torch.Tensor:
    return qweight.new_empty(ids.shape[0], dim, dtype=torch.float32)


@functools.cache
def _chosen(device: str, path: str) -> None:
    logger.info("GGUF quantized linear layers on %s: %s", device, path)


@functools.cache
def _chosen_path(kernel, qtype: GGMLQuantizationType, activations: str) -> None:  # type: ignore[no-untyped-def]
    logger.info("GGUF %s layers with %s activations: the %s loop", qtype.name, activations,
                kernel.kernel_path(int(qtype), activations))
