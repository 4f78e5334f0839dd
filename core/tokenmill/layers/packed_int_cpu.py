"""The CPU kernel for grouped weight-only int linear layers (GPTQ, AWQ, compressed-tensors' W4A16 / W8A16).

The three plugins keep their own checkpoint layouts and loaders; once a layer's weights are
loaded each hands its values in one form, ``q`` ``[K, N]`` (unpacked), ``zeros`` and ``scales``
``[G, N]`` and ``g_idx`` ``[K]``, to :func:`pack_for_cpu`, which writes them once into the
layout the C++ kernel (``csrc/packed_int_linear.cpp``, AVX-512 F/BW/VL, or AVX2 on 8-lane vectors) reads: GPTQ-style int32
words of 4- or 8-bit values regrouped in tiles of 16 outputs, the inputs reordered so that each group's are
contiguous (act order: ``g_idx`` any assignment of inputs to groups; each call gathers x's
columns in that order) and padded to a multiple of 8. The kernel dequantises in registers and
multiplies in float32, so its output is the dequantised weight's product up to the order of
the float32 sums; with AVX512_VNNI, up to 8 rows of x (decode) are instead rounded to int8
planes (2 for bfloat16 / float16 x, 3 for float32: within 2^-16 / 2^-23 of each group's largest
|x|) and multiplied in int32, the weight's values untouched (on AVX2, up to 4 rows of 4-bit values
by vpmaddubsw, the same planes). The torch path (:mod:`tokenmill.layers.packed_int`) stays the reference it is
tested against, and runs wherever the kernel does not (another device, neither AVX-512 nor AVX2, no
compiler, 2-bit values).

The kernel lives in core, beside the torch path it replaces, rather than in one of the plugins
(a plugin may not import another's package) or in the CPU platform (whose kernels are built for
the platform and would need a layer-op seam for a layout that is the quantization methods').
It is a torch op, ``torch.ops.tokenmill_packed_int.packed_int_linear``, with an ``.out``
overload, so that the CPU platform's step graphs record it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.layers.packed_int import pack_rows
from tokenmill.native_extension import optional_native_extension

logger = logging.getLogger(__name__)

KERNEL_BITS = (4, 8)
TILE_COLUMNS = 16  # outputs of one float32 register
POSITION_ALIGN = 8  # every group's inputs padded to whole words (8 positions of 4-bit values)
FLOAT_2_23 = float(2**23)  # the kernel reads a value as the float 2^23 + q (its bits or-ed in)
MODULE_NAME = "tokenmill_packed_int_kernel"
SOURCE = Path(__file__).with_name("csrc") / "packed_int_linear.cpp"
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512"]


@dataclass(frozen=True)
class CpuPackedInt:
    """One layer's weights in the kernel's layout (see ``csrc/packed_int_linear.cpp``)."""

    packed: torch.Tensor  # int32 [tiles, K_p * bits / 32, 16]
    scales: torch.Tensor  # float32 [G, tiles * 16]
    zeros: torch.Tensor  # float32 [G, tiles * 16]: 2^23 + zero
    x_index: torch.Tensor  # int32 [K_p]: the input each position reads, -1: padding
    group_start: torch.Tensor  # int32 [G + 1]: each group's first position
    bits: int
    in_features: int
    out_features: int
    bias: torch.Tensor | None  # float32 [N]


def pack_for_cpu(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None) -> CpuPackedInt:
    """The kernel's layout of ``W[k, n] = scales[g, n] * (q[k, n] - zeros[g, n])``, ``g = g_idx[k]``."""
    k, n = q.shape
    groups = scales.shape[0]
    group_of = g_idx.long()
    order = torch.argsort(group_of, stable=True)  # the inputs, group by group
    counts = torch.bincount(group_of, minlength=groups)
    starts = torch.zeros(groups + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum((counts + POSITION_ALIGN - 1) // POSITION_ALIGN * POSITION_ALIGN, 0)
    positions = int(starts[-1])
    sorted_groups = group_of[order]
    rank_in_group = torch.arange(k) - (torch.cumsum(counts, 0) - counts)[sorted_groups]
    where = starts[sorted_groups] + rank_in_group  # each sorted input's position
    x_index = torch.full((positions,), -1, dtype=torch.int32)
    x_index[where] = order.to(torch.int32)
    tiles = -(-n // TILE_COLUMNS)
    values = torch.zeros(positions, tiles * TILE_COLUMNS, dtype=torch.int32)
    values[where, :n] = q[order].to(torch.int32)
    # GPTQ's words (32 / bits positions of one column, the first in the lowest bits), tile by tile
    packed = pack_rows(values, bits).view(-1, tiles, TILE_COLUMNS).transpose(0, 1).contiguous().view(-1)
    padded_scales = torch.zeros(groups, tiles * TILE_COLUMNS, dtype=torch.float32)
    padded_scales[:, :n] = scales.float()
    padded_zeros = torch.full((groups, tiles * TILE_COLUMNS), FLOAT_2_23, dtype=torch.float32)
    padded_zeros[:, :n] += zeros.float()  # 2^23 + zero, exact while |zero| < 2^22
    return CpuPackedInt(packed, padded_scales, padded_zeros, x_index, starts.to(torch.int32), bits, k, n,
                        None if bias is None else bias.detach().float().contiguous())


def cpu_packed_int_linear(x: torch.Tensor, weights: CpuPackedInt) -> torch.Tensor:
    """``x @ W (+ bias)`` for ``x`` ``[..., K]`` by the kernel, in ``x``'s dtype."""
    if not packed_int_kernel_runs():  # (cached) loading the kernel registers its op
        raise RuntimeError("the packed-int CPU kernel does not run here (neither AVX-512 F/BW/VL nor AVX2, or no compiler)")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.tokenmill_packed_int.packed_int_linear(rows, weights.packed, weights.scales, weights.zeros,
                                                           weights.x_index, weights.group_start, weights.bits,
                                                           weights.out_features, weights.bias)
    return out.reshape(*x.shape[:-1], weights.out_features)


def cpu_packed_int_weights(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
                           bias: torch.Tensor | None, method: str) -> CpuPackedInt | None:
    """The layer's weights packed for the CPU kernel where it takes them, else None (the caller's
    torch path runs); which of the two runs is logged once per method and reason."""
    reason = _refusal(q, zeros, bits)
    if reason is None and not packed_int_kernel_runs():
        reason = "the kernel does not run here (see the log line above)"
    if reason is not None:
        _chosen(method, f"torch reference: dequantise, then matmul ({reason})")
        return None
    decode = ("decode rows of x as int8 planes times the values in integers" if packed_int_integer_decode()
              else "decode rows too")
    _chosen(method, f"the packed-int kernel, {packed_int_kernel_isa()} ({bits}-bit values dequantised in registers; "
                    f"{decode})")
    return pack_for_cpu(q, zeros, scales, g_idx, bits, bias)


# An expert's (q [K, N], zeros [G, N], scales [G, N], g_idx [K]) for a stack ("gate_up_proj", "down_proj")
ExpertValues = Callable[[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
EXPERT_STACKS = ("gate_up_proj", "down_proj")


def cpu_packed_int_experts(values: ExpertValues, experts: int, bits: int,
                           method: str) -> dict[str, list[CpuPackedInt]] | None:
    """A MoE layer's experts packed for the CPU kernel, stack by stack and expert by expert (the
    quantized MoE methods' per-expert matmuls then run on it, ``cpu_packed_int_linear``), or None
    where the kernel does not take them (the caller's torch path runs; logged as for the linear
    layers). ``values(stack, expert)`` gives an expert's unpacked values, zeros, scales and g_idx."""
    packed: dict[str, list[CpuPackedInt]] = {}
    for stack in EXPERT_STACKS:
        packed[stack] = []
        for expert in range(experts):
            weights = cpu_packed_int_weights(*values(stack, expert), bits, None, method)
            if weights is None:
                return None
            packed[stack].append(weights)
    return packed


def _refusal(q: torch.Tensor, zeros: torch.Tensor, bits: int) -> str | None:
    if q.device.type != "cpu":
        return f"weights on {q.device.type}"
    if bits not in KERNEL_BITS:
        return f"{bits}-bit values; the kernel takes {' and '.join(map(str, KERNEL_BITS))}"
    if zeros.numel() and int(zeros.abs().max()) >= 2**22:
        return "zero points beyond 2^22"
    return None


@functools.cache
def _chosen(method: str, path: str) -> None:
    logger.info("%s linear layers on cpu: %s", method, path)


def packed_int_kernel_runs() -> bool:
    """Whether the kernel is built for this CPU (compiled on first use, once per source and
    machine); loading it registers ``torch.ops.tokenmill_packed_int``. Logged once."""
    return _kernel() is not None


def packed_int_kernel_isa() -> str:
    """The instruction set the kernel was built for (``"avx512+vnni"``, ``"avx2"``, ...; ``"none"``
    where it does not run)."""
    module = _kernel()
    return "none" if module is None else str(module.isa())


def packed_int_integer_decode() -> bool:
    """Whether the kernel has its integer decode path: a few rows of x staged as int8 planes and
    multiplied by vpdpbusd (AVX512_VNNI: up to 8 rows, 4- and 8-bit values) or vpmaddubsw (AVX2: up
    to 4 rows, 4-bit values), rather than the float path's dequantised values."""
    module = _kernel()
    return module is not None and ("vnni" in module.isa() or "int4" in module.isa())


@functools.cache
def _kernel() -> ModuleType | None:
    return optional_native_extension(MODULE_NAME, "packed-int", [SOURCE], CFLAGS, "packed-int CPU kernel",
                                     fallback="the torch path of GPTQ/AWQ/compressed-tensors int layers",
                                     needs="AVX-512 F/BW/VL or AVX2")
