"""The CPU platform's layer ops: fused C++ kernels for the elementwise ops
(float32 and bfloat16), a C++ kernel for linear layers of a few rows (float32
and bfloat16), a kernel on packed weights for float32 decode batches
(larger bfloat16 matmuls go to torch, which runs them on oneDNN, with AMX where
the CPU has it; on a CPU without AVX-512, where torch's bfloat16 matmul is a scalar
loop ~100x slower than float32's, the kernels' AVX2 build packs bfloat16 weights too and
takes their matmuls at every row count); anything else goes to the torch reference they
are tested against.

Packed matmuls: after loading, each float32 linear weight is copied once into
column panels (``kernels/panel_matmul.cpp``), and matmuls of
``PACKED_MIN_ROWS`` to ``PACKED_MAX_ROWS`` rows (decode batches) run on them with
the next panel prefetched while one is computed: the weights of a decode step
come from DRAM, where that beat MKL's packed GEMM by 10-30% (by batch size),
which in turn was 1.5-2x faster than MKL's plain ``sgemm`` (it repacks the weight
on every call). Fewer rows go to the small-matmul kernel; more (prefill chunks)
to torch's matmul on the plain weight, which is kept for them. The packed copies
take as much memory again as the weights they copy: the platform bounds them
(``TOKENMILL_PACKED_WEIGHTS``, default a quarter of available RAM).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from tokenmill.layers import NativeLayerOps
from tokenmill_platform_cpu.moe import grouped_fused_moe
from tokenmill_platform_cpu.step_graph import active_kernels

# The fused kernels' dtypes (bfloat16 is computed in float32 and rounded once).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PACKED_MIN_ROWS = 3
# Past this, torch's matmul (MKL sgemm on the plain weight) is as fast or faster: at 256
# rows both ran at ~257 GFLOP/s on a 100m model's weights, at 384-512 rows sgemm was
# 7-13% ahead on tiny's.
PACKED_MAX_ROWS = 256
# bfloat16 panels exist only in the kernels' AVX2 build (``packed_linear_dtypes``), where torch's
# own bfloat16 matmul is a scalar loop: 0.9 GFLOP/s on two Zen 3 cores against the panels' ~100
# at any row count, so they take prefill chunks too.
PACKED_MAX_ROWS_BY_DTYPE = {torch.float32: PACKED_MAX_ROWS, torch.bfloat16: 1 << 62}
# Matmuls of at most this many rows (by dtype) go to the C++ small-matmul kernel,
# which reads the weights faster than torch does: bfloat16 ~2x (one to four rows),
# 1.3x (six; as fast at eight), float32 ~1.1x at one row (MKL's sgemv) and as fast
# at two; from three rows float32 goes to the packed panels.
SMALL_MAX_ROWS = {torch.float32: 2, torch.bfloat16: 6}
# The grouped MoE kernel takes layers of at most this many token-expert pairs per expert
# (decode batches); past it (prefill chunks) torch's matmuls per expert (MKL, oneDNN) were
# as fast or faster: at 75 pairs an expert (300 tokens, top-2 of 8, 512 x 1024) the torch
# grouping ran in 0.8-0.9x the kernel's time, at 16 (64 tokens) in 1.1-1.8x.
GROUPED_KERNEL_MAX_PAIRS_PER_EXPERT = 32
# With the experts packed at load (the kernel's lane tiles, kernels/moe_lane_tiles.h) the kernel
# also wins on prefill chunks, ahead of the reference loop and the torch grouping (session 7,
# bench-moe-layer.py, one thread, top-2 of 8, 512 x 1024): float32 1.4-1.6x the loop from 300 to
# 2048 tokens (512 pairs an expert); bfloat16 1.1-1.3x to 1024 tokens (256), but 0.62x at 2048.
GROUPED_KERNEL_MAX_PAIRS_PER_EXPERT_PACKED = {torch.float32: 512, torch.bfloat16: 256}


class CpuLayerOps(NativeLayerOps):
    """``packed_budget``: bytes the packed weight copies of the engine being built may
    take in all (each packed weight sits beside its plain one, so packing doubles a
    model's linear weights); weights past it stay unpacked. The platform makes a new
    instance, with a fresh budget, for each engine."""

    def __init__(self, kernels: ModuleType, packed_budget: int) -> None:
        self._kernels = kernels
        # rows per dtype for the small-matmul kernel, for the dtypes it has a vector body for in this build
        self._small_max_rows = {dtype: SMALL_MAX_ROWS[dtype]
                                for dtype in (getattr(torch, name) for name in kernels.small_linear_dtypes())}
        self._packed_dtypes = {getattr(torch, name) for name in kernels.packed_linear_dtypes()}
        self._grouped_moe_dtypes = {getattr(torch, name) for name in kernels.grouped_moe_dtypes()}
        self._packed_budget = packed_budget

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        if weight.dtype not in self._packed_dtypes or weight.dim() != 2:
            return None
        size = weight.numel() * weight.element_size()
        if size > self._packed_budget:
            return None
        self._packed_budget -= size
        return self._kernels.pack_linear_weight(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               prepared: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if 1 <= rows <= self._small_max_rows.get(x.dtype, 0) and x.dtype == weight.dtype:
            out = active_kernels(self._kernels).small_linear(x.reshape(rows, -1), weight, bias)
        elif (prepared is not None and x.dtype == prepared.dtype
              and PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS_BY_DTYPE.get(x.dtype, 0)):
            out = active_kernels(self._kernels).packed_linear(x.reshape(rows, -1), prepared, weight.shape[0], bias)
        else:
            return F.linear(x, weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps)
        return active_kernels(self._kernels).rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        if not _fused_add_applies(x, residual, weight):
            return super().add_rms_norm(x, residual, weight, eps)
        return active_kernels(self._kernels).add_rms_norm_(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES:
            return super().silu_and_mul(x)
        return active_kernels(self._kernels).silu_and_mul(x)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not _rotary_applies(q, k, cos_cache):
            return super().rotary(positions, q, k, cos_cache, sin_cache)
        active_kernels(self._kernels).rotary_embedding_(positions, q, k, cos_cache, sin_cache)
        return q, k

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        if topk_ids.dim() == 2 and self._grouped_kernel_applies(x, w13, w2, topk_ids.shape[1]):
            return active_kernels(self._kernels).grouped_moe(x, w13, w2, topk_weights, topk_ids)
        # Fewer token-expert pairs than experts (decode of a batch or two): each expert gets a
        # row or so, grouping buys nothing and its sort costs ~1 ms (measured at batch 1:
        # reference 5.3 ms, grouped 6.3 ms per layer of 8 experts, 512 x 1024).
        if x.dim() != 2 or topk_ids.numel() < w13.shape[0]:
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids)
        return grouped_fused_moe(x, w13, w2, topk_weights, topk_ids, self.silu_and_mul)

    def prepare_moe_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor | None:
        """Once, after loading: the experts packed for the kernel's lane tiles (a copy beside
        them, of their size plus tile padding), for the dtypes the kernel has a vector body for,
        charged to the same packed-weight budget as the linear layers' panels (past it the
        experts stay unpacked: the kernel's row-dot tiles run them)."""
        if not (w13.dtype == w2.dtype and w13.dtype in self._grouped_moe_dtypes and w13.dim() == w2.dim() == 3):
            return None
        if w13.nbytes + w2.nbytes > self._packed_budget:
            return None
        packed = self._kernels.pack_moe_experts(w13, w2)
        self._packed_budget -= packed.nbytes
        return packed

    def prepared_fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, prepared: torch.Tensor) -> torch.Tensor | None:
        """``fused_moe`` on the experts' packed copy (``prepare_moe_experts``), for a layer whose
        routing ran outside the kernel (DeepSeek's grouped top-k with a correction bias and a
        scaling factor, or any other): experts with a block of rows take the lane tiles, as
        ``routed_fused_moe`` does for softmax top-k. None where the kernel does not apply."""
        if topk_ids.dim() != 2 or not self._grouped_kernel_applies(x, w13, w2, topk_ids.shape[1], packed=True):
            return None
        return active_kernels(self._kernels).grouped_moe(x, w13, w2, topk_weights, topk_ids, packed=prepared)

    def routed_fused_moe(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         top_k: int, renormalize: bool, expert_load: torch.Tensor,
                         prepared: torch.Tensor | None = None) -> torch.Tensor | None:
        """A whole MoE layer from its router logits in one kernel call (softmax, top-k, the
        ``expert_load`` count, the experts: ``kernels/grouped_moe.cpp``), which a step graph
        records, so MoE decode steps replay; None where the kernel does not apply.
        ``prepared``: what ``prepare_moe_experts`` returned (the kernel then runs experts with
        a block of rows on the packed copy)."""
        if not self._grouped_kernel_applies(x, w13, w2, top_k, prepared is not None) or router_logits.dim() != 2:
            return None
        kernels = active_kernels(self._kernels)
        if prepared is None:
            return kernels.routed_moe(x, router_logits, w13, w2, top_k, renormalize, expert_load)
        return kernels.routed_moe(x, router_logits, w13, w2, top_k, renormalize, expert_load, packed=prepared)

    def _grouped_kernel_applies(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                                packed: bool = False) -> bool:
        limit = (GROUPED_KERNEL_MAX_PAIRS_PER_EXPERT_PACKED.get(x.dtype, GROUPED_KERNEL_MAX_PAIRS_PER_EXPERT) if packed
                 else GROUPED_KERNEL_MAX_PAIRS_PER_EXPERT)
        return (x.dim() == 2 and x.dtype in self._grouped_moe_dtypes and w13.dtype == w2.dtype == x.dtype
                and x.shape[0] * top_k <= limit * w13.shape[0])

    # -- LoRA (tokenmill.lora.layers.LoRADeltaOps): the C++ kernel, which step graphs can record --
    def lora_delta_supported(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32

    def lora_delta_into(self, x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor,
                        token_slots: torch.Tensor, num_slots: int, slices: list[int]) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return active_kernels(self._kernels).lora_delta_(x, out, lora_a, lora_b_t, token_slots, num_slots, slices)


def _fused_add_applies(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype in KERNEL_DTYPES and x.dtype == residual.dtype == weight.dtype and x.is_contiguous()
            and residual.is_contiguous() and x.shape == residual.shape)


def _rotary_applies(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor) -> bool:
    return (q.dtype in KERNEL_DTYPES and q.dtype == k.dtype and cos_cache.dtype == torch.float32
            and q.dim() == k.dim() == 3 and q.stride(2) == 1 and k.stride(2) == 1 and q.shape[2] % 2 == 0)
