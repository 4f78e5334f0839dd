"""The CPU platform's fused MoE: token-expert pairs sorted by expert, one matmul per expert.

The reference (``NativeLayerOps.fused_moe``) gathers, activates, weights and adds back
each expert's tokens separately: per expert per layer ~8 small ops, each with Python
and dispatch overhead. Here the pairs are sorted by expert once, so every expert's
rows lie together: one gather of the token rows, the gate/up matmuls of all experts
(``torch._grouped_mm`` over the experts' row ranges, where this torch runs it on the
CPU for the dtype; else one ``matmul`` per expert that got rows, into one buffer), one
SiLU-and-multiply (the platform's fused kernel) over all rows, the down matmuls the
same way, one multiply by the routing weights and one ``index_add`` back to the tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def grouped_mm_runs(dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on CPU tensors of ``dtype`` here (a tiny trial,
    once per dtype: it needs a recent torch, and its CPU support varies by version)."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return False
    try:
        x = torch.ones(3, 8, dtype=dtype)
        w = torch.ones(2, 8, 8, dtype=dtype)
        out = grouped_mm(x, w, offs=torch.tensor([1, 3], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(out.shape == (3, 8) and torch.all(out == 8))


def _strides_fit(*tensors: torch.Tensor) -> bool:
    """``torch._grouped_mm`` wants every non-unit stride a multiple of 16 bytes."""
    return all(stride == 1 or (stride * t.element_size()) % 16 == 0 for t in tensors for stride in t.stride())


def _expert_matmuls(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                    use_grouped_mm: bool) -> torch.Tensor:
    """``rows`` [N, K] sorted by expert (``counts[e]`` rows each) times each expert's
    ``weights[e]`` [M, K] transposed -> [N, M]."""
    if use_grouped_mm and _strides_fit(rows, weights):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            torch.matmul(rows[start:start + count], weights[expert].t(), out=out[start:start + count])
            start += count
    return out


def grouped_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor,
                      silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """What ``LayerOps.fused_moe`` computes (see there), grouped by expert."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair index, grouped by expert
    token_of_row = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0])
    use_grouped_mm = grouped_mm_runs(x.dtype) and w13.dtype == x.dtype
    rows = x.index_select(0, token_of_row)
    hidden = silu_and_mul(_expert_matmuls(rows, w13, counts, use_grouped_mm).contiguous())
    down = _expert_matmuls(hidden, w2, counts, use_grouped_mm)
    down = down * topk_weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of_row, down.to(out.dtype))
    return out
