"""A Triton fused MoE for the CUDA platform: every expert's rows in one grouped GEMM launch.

The token-expert pairs are sorted by expert and each expert's run padded to a multiple
of ``block_m`` (:func:`align_to_blocks`), so every row block of the sorted list belongs
to one expert; the kernel's program ``(block, column tile)`` reads that expert's weight
tile and the block's rows (gathered from the tokens on the fly, never copied), and
writes each row to its pair's place. Two launches of one kernel:

- gate/up: each program computes a gate tile and the matching up tile side by side
  (rows ``n`` and ``I + n`` of ``w13``) and writes ``silu(gate) * up`` ``[pairs, I]``:
  the ``[pairs, 2I]`` product never reaches memory;
- down: with the pair's routing weight applied in the epilogue; the k rows of a token
  are summed at the end (``[T, k, H] -> [T, H]``).

Quantized experts (:func:`triton_fused_moe_quantized`): float8_e4m3fn or int8 weights
with one float32 scale per expert and output row (a per-expert scale is that scale on
every row); activations quantized per token (per pair row for the down launch) to the
weights' type, the tiles multiplied in it (float32 / int32 accumulators) and scaled back
in the epilogue. FP8 weights may also run with unquantized activations: each weight tile
is converted to the activations' dtype in registers.

The alignment never reads a tensor back to the host (its sizes are bounds from the
shapes, blocks past the last expert's run hold expert -1 and return at once), so a step
that runs it can be captured in a CUDA graph. Tile sizes come from
:mod:`tokenmill_platform_cuda.fused_moe_configs` (a table written by
``scripts/tune-fused-moe.py``, a default by size where it has no entry).

Tested against the torch reference (``NativeLayerOps.fused_moe``, on dequantised weights
for the quantized variants) under ``TRITON_INTERPRET=1`` on the CPU, and on a GPU when one
is lent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from tokenmill_platform_cuda.fused_moe_configs import TileConfig, choose_config, packaged_table, table_key

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
INT8_MAX = 127
_MIN_SCALE = 1e-12  # as the quantization plugins: an all-zero row still gets a finite scale
QUANTIZED_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8)
# rows [M, K] -> (quantized [M, K], float32 scale per row [M])
RowQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@triton.jit
def _grouped_gemm(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
                  num_pairs, n_size, k_size,
                  stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_cm, stride_cn,
                  rows_per_a: tl.constexpr, gated: tl.constexpr, apply_weights: tl.constexpr,
                  a_scaled: tl.constexpr, w_scaled: tl.constexpr, upcast_w: tl.constexpr,
                  acc_dtype: tl.constexpr, precision: tl.constexpr,
                  block_m: tl.constexpr, block_n: tl.constexpr, block_k: tl.constexpr):
    """``c[pair] = a[pair // rows_per_a] @ w[expert].T`` over ``n_size`` columns; ``gated``:
    ``silu(a @ w[:n].T) * (a @ w[n:2n].T)``; times the row and column scales, times the
    pair's routing weight with ``apply_weights``."""
    block = tl.program_id(0)
    tile = tl.program_id(1)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:  # past the last expert's run
        return
    offs_m = block * block_m + tl.arange(0, block_m)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs  # padding rows hold num_pairs
    a_rows = pairs // rows_per_a
    offs_n = tile * block_n + tl.arange(0, block_n)
    n_mask = offs_n < n_size
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((block_m, block_n), dtype=acc_dtype)
    acc_up = tl.zeros((block_m, block_n), dtype=acc_dtype)
    for k0 in range(0, k_size, block_k):
        offs_k = k0 + tl.arange(0, block_k)
        k_mask = offs_k < k_size
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_tile = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_tile, mask=w_mask, other=0.0)
        if upcast_w:
            w = w.to(a.dtype)
        acc += tl.dot(a, w, out_dtype=acc_dtype, input_precision=precision)
        if gated:
            w_up = tl.load(w_tile + n_size * stride_wn, mask=w_mask, other=0.0)
            if upcast_w:
                w_up = w_up.to(a.dtype)
            acc_up += tl.dot(a, w_up, out_dtype=acc_dtype, input_precision=precision)
    out = acc.to(tl.float32)
    up = acc_up.to(tl.float32)
    if a_scaled:
        row_scale = tl.load(a_scale_ptr + a_rows, mask=valid, other=0.0)[:, None]
        out = out * row_scale
        up = up * row_scale
    if w_scaled:
        out = out * tl.load(w_scale_ptr + expert * stride_se + offs_n, mask=n_mask, other=0.0)[None, :]
        if gated:
            up = up * tl.load(w_scale_ptr + expert * stride_se + n_size + offs_n, mask=n_mask, other=0.0)[None, :]
    if gated:
        out = out * tl.sigmoid(out) * up
    if apply_weights:
        out = out * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             out.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_experts)``: the pair indices (``t * k + j``) sorted by expert,
    each expert's run padded with ``num_pairs`` to a multiple of ``block_m``; and the
    expert of each block of ``block_m`` entries. Experts without pairs get no block; the
    list is as long as the worst case (every expert that can get a pair padding a whole
    block less one), the blocks past the runs have expert -1. Nothing is read back to the host."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat[order]
    run_start = torch.cumsum(counts, 0) - counts
    padded_end = torch.cumsum(padded, 0)
    rank_in_run = torch.arange(num_pairs, device=flat.device) - run_start[experts_in_order]
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[(padded_end - padded)[experts_in_order] + rank_in_run] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)  # the run a block starts in
    return sorted_pairs, torch.where(block_experts < num_experts, block_experts, -1)


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
            block_experts: torch.Tensor, config: TileConfig, *, rows_per_a: int, gated: bool,
            weights: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
            w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [pairs, N] from ``a`` [rows, K] and ``w`` [E, N (2N gated), K]."""
    n_size = out.shape[1]
    integer = a.dtype == torch.int8
    grid = (block_experts.numel(), triton.cdiv(n_size, config.block_n))
    _grouped_gemm[grid](
        a, a_scale if a_scale is not None else out, w, w_scale if w_scale is not None else out, out,
        sorted_pairs, block_experts, weights if weights is not None else out,
        out.shape[0], n_size, w.shape[2],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        w_scale.stride(0) if w_scale is not None else 0, out.stride(0), out.stride(1),
        rows_per_a=rows_per_a, gated=gated, apply_weights=weights is not None,
        a_scaled=a_scale is not None, w_scaled=w_scale is not None, upcast_w=w.dtype != a.dtype,
        acc_dtype=tl.int32 if integer else tl.float32,
        precision="ieee" if a.dtype == torch.float32 else None,
        block_m=config.block_m, block_n=config.block_n, block_k=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def tile_config(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> TileConfig:
    """The table's config for this layer on this device (a default by size where it has none)."""
    return _tile_config(x.device, w13.shape[0], w13.shape[2], w13.shape[1] // 2, w13.dtype, x.shape[0], top_k)


@functools.cache
def _tile_config(device: torch.device, experts: int, hidden: int, inter: int, dtype: torch.dtype, tokens: int,
                 top_k: int) -> TileConfig:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = table_key(experts, hidden, inter, str(dtype).removeprefix("torch."), name)
    return choose_config(packaged_table(), key, tokens, top_k, experts)


def triton_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """What ``LayerOps.fused_moe`` computes (``x`` [T, H], ``w13`` [E, 2I, H], ``w2``
    [E, H, I], ``topk_*`` [T, k]), in two grouped-GEMM launches."""
    return _fused_moe(x, x, None, w13, None, w2, None, topk_weights, topk_ids, config)


def triton_fused_moe_quantized(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                               w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                               quantize_activations: bool = True, config: TileConfig | None = None) -> torch.Tensor:
    """The experts of float8_e4m3fn or int8 ``w13`` / ``w2`` (as ``triton_fused_moe``'s) with
    float32 row scales ``w13_scale`` [E, 2I] and ``w2_scale`` [E, H] (``[E]`` or ``[E, 1]``:
    one per expert); ``x @ w.T`` is ``(xq @ wq.T) * x_scale * w_scale``. Activations are
    quantized per row to the weights' type unless ``quantize_activations`` is False (FP8
    weights only: then the weights are converted to ``x``'s dtype tile by tile). -> [T, H]
    in ``x``'s dtype."""
    if w13.dtype not in QUANTIZED_WEIGHT_DTYPES or w2.dtype != w13.dtype:
        raise ValueError(f"quantized experts are float8_e4m3fn or int8, not {w13.dtype} / {w2.dtype}")
    if not quantize_activations and w13.dtype == torch.int8:
        raise ValueError("int8 experts take int8 activations (W8A8): quantize_activations must be True")
    quantize: RowQuantizer | None = functools.partial(quantize_per_row, dtype=w13.dtype) if quantize_activations else None
    a, a_scale = quantize(x) if quantize else (x, None)
    return _fused_moe(x, a, a_scale, w13, _row_scales(w13_scale, w13), w2, _row_scales(w2_scale, w2),
                      topk_weights, topk_ids, config, quantize)


def _fused_moe(x: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor | None, w13: torch.Tensor,
               w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
               topk_weights: torch.Tensor, topk_ids: torch.Tensor, config: TileConfig | None,
               quantize_hidden: RowQuantizer | None = None) -> torch.Tensor:
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    config = config or tile_config(x, w13, top_k)
    sorted_pairs, block_experts = align_to_blocks(topk_ids, w13.shape[0], config.block_m)
    hidden = x.new_empty(num_pairs, w13.shape[1] // 2)
    _launch(a, w13, hidden, sorted_pairs, block_experts, config, rows_per_a=top_k, gated=True,
            a_scale=a_scale, w_scale=w13_scale)
    hidden_scale = None
    if quantize_hidden is not None:
        hidden, hidden_scale = quantize_hidden(hidden)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down = x.new_empty(num_pairs, w2.shape[1])
    _launch(hidden, w2, down, sorted_pairs, block_experts, config, rows_per_a=1, gated=False, weights=weights,
            a_scale=hidden_scale, w_scale=w2_scale)
    return down.view(tokens, top_k, -1).sum(dim=1)


def quantize_per_row(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric quantization of each row of ``x`` to ``dtype`` (float8_e4m3fn or int8),
    as the quantization plugins round their activations: ``(quantized, float32 scales [rows])``."""
    limit = FP8_MAX if dtype == torch.float8_e4m3fn else INT8_MAX
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) / limit
    scaled = x.float() / scale
    if dtype == torch.int8:
        scaled = torch.round(scaled)
    return scaled.clamp(-limit, limit).to(dtype), scale.reshape(-1)


def _row_scales(scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-expert or per-expert-and-row scales as ``[E, rows]`` float32, contiguous."""
    experts, rows = weight.shape[0], weight.shape[1]
    return scale.reshape(experts, -1).float().expand(experts, rows).contiguous()
