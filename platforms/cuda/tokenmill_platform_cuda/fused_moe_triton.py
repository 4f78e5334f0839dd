"""A Triton fused MoE for the CUDA platform: every expert's rows in one grouped GEMM launch.

The token-expert pairs are sorted by expert and each expert's run padded to a multiple
of ``BLOCK_M`` (:func:`align_to_blocks`), so every row block of the sorted list belongs
to one expert; the kernel's program ``(block, column tile)`` reads that expert's weight
tile and the block's rows (gathered from the tokens on the fly, never copied), and
writes each row to its pair's place. Two launches: gate/up (``[pairs, 2I]``), then,
after SiLU-and-multiply, down with the routing weight applied in the epilogue; the k
pairs of a token are summed at the end. Tested against the torch reference under
``TRITON_INTERPRET=1`` on the CPU, and on a GPU when one is lent.

Not yet: the activation fused into the first launch, FP8/INT8 experts, a tuned tile table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _grouped_gemm(a_ptr, w_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
                  num_pairs, n_size, k_size,
                  stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
                  rows_per_a: tl.constexpr, apply_weights: tl.constexpr, precision: tl.constexpr,
                  block_m: tl.constexpr, block_n: tl.constexpr, block_k: tl.constexpr):
    """``c[pair] = a[pair // rows_per_a] @ w[expert].T`` (times the pair's routing weight)."""
    block = tl.program_id(0)
    tile = tl.program_id(1)
    expert = tl.load(block_experts_ptr + block)
    offs_m = block * block_m + tl.arange(0, block_m)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs  # padding rows hold num_pairs
    a_rows = pairs // rows_per_a
    offs_n = tile * block_n + tl.arange(0, block_n)
    acc = tl.zeros((block_m, block_n), dtype=tl.float32)
    for k0 in range(0, k_size, block_k):
        offs_k = k0 + tl.arange(0, block_k)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & (offs_k[None, :] < k_size), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=(offs_k[:, None] < k_size) & (offs_n[None, :] < n_size), other=0.0)
        acc += tl.dot(a, w, input_precision=precision)
    if apply_weights:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < n_size))


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_experts)``: the pair indices (``t * k + j``) sorted by expert,
    each expert's run padded with ``num_pairs`` to a multiple of ``block_m``; and the
    expert of each block of ``block_m`` entries. Experts without pairs get no block."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat[order]
    run_start = torch.cumsum(counts, 0) - counts
    padded_start = torch.cumsum(padded, 0) - padded
    rank_in_run = torch.arange(num_pairs, device=flat.device) - run_start[experts_in_order]
    sorted_pairs = torch.full((int(padded.sum().item()),), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[padded_start[experts_in_order] + rank_in_run] = order
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return sorted_pairs, block_experts


def _launch(a: torch.Tensor, w: torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
            num_pairs: int, rows_per_a: int, weights: torch.Tensor | None) -> torch.Tensor:
    out = a.new_empty(num_pairs, w.shape[1])
    grid = (block_experts.numel(), triton.cdiv(w.shape[1], BLOCK_N))
    _grouped_gemm[grid](
        a, w, out, sorted_pairs, block_experts, weights if weights is not None else out,
        num_pairs, w.shape[1], w.shape[2],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        rows_per_a=rows_per_a, apply_weights=weights is not None,
        precision="ieee" if a.dtype == torch.float32 else "tf32",
        block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K,
    )
    return out


def triton_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """What ``LayerOps.fused_moe`` computes (``x`` [T, H], ``w13`` [E, 2I, H], ``w2``
    [E, H, I], ``topk_*`` [T, k]), in two grouped-GEMM launches."""
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    sorted_pairs, block_experts = align_to_blocks(topk_ids, w13.shape[0])
    gate_up = _launch(x, w13, sorted_pairs, block_experts, num_pairs, top_k, None)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (torch.nn.functional.silu(gate) * up).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down = _launch(hidden, w2, sorted_pairs, block_experts, num_pairs, 1, weights)
    return down.view(tokens, top_k, -1).sum(dim=1)
