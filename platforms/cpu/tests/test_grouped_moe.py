"""The CPU platform's expert-grouped fused MoE against the torch reference loop."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import NativeLayerOps
from tokenmill_platform_cpu import moe
from tokenmill_platform_cpu.moe import grouped_fused_moe, grouped_mm_runs

NATIVE = NativeLayerOps()
EXPERTS, HIDDEN, INTER = 8, 32, 24


def _case(tokens: int, top_k: int, dtype: torch.dtype, experts_used: int = EXPERTS, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) / INTER**0.5).to(dtype)
    scores = torch.rand(tokens, experts_used, generator=generator)
    weights, ids = torch.topk(torch.softmax(scores, -1), top_k, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_grouped_matches_the_reference(tokens, top_k):
    x, w13, w2, weights, ids = _case(tokens, top_k, torch.float32)
    expected = NATIVE.fused_moe(x, w13, w2, weights, ids)
    got = grouped_fused_moe(x, w13, w2, weights, ids, NATIVE.silu_and_mul)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_experts_without_tokens_are_skipped(tokens):
    """Only experts 0-2 are routed to; 3-7 get no rows (empty groups in the middle of none)."""
    x, w13, w2, weights, ids = _case(tokens, 2, torch.float32, experts_used=3)
    w13[3:] = float("nan")  # an expert that got no tokens must not be read into the output
    w2[3:] = float("nan")
    got = grouped_fused_moe(x, w13, w2, weights, ids, NATIVE.silu_and_mul)
    torch.testing.assert_close(got, NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("use_grouped_mm", [False, True])
def test_a_middle_expert_without_tokens_on_both_matmul_paths(use_grouped_mm, monkeypatch):
    """Expert 4 of 8 gets no rows: an empty group between two full ones, through the
    per-expert matmul loop and through torch._grouped_mm (where this torch runs it)."""
    if use_grouped_mm and not grouped_mm_runs(torch.float32):
        pytest.skip("torch._grouped_mm does not run on the CPU here")
    monkeypatch.setattr(moe, "grouped_mm_runs", lambda dtype: use_grouped_mm)
    x, w13, w2, weights, _ = _case(16, 2, torch.float32)
    pairs = [(e, f) for e in range(EXPERTS) for f in range(EXPERTS) if e != f and 4 not in (e, f)]
    ids = torch.tensor([pairs[(7 * t) % len(pairs)] for t in range(16)])
    got = moe.grouped_fused_moe(x, w13, w2, weights, ids, NATIVE.silu_and_mul)
    torch.testing.assert_close(got, NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [7, 64])
def test_bfloat16_within_its_rounding(tokens):
    x, w13, w2, weights, ids = _case(tokens, 2, torch.bfloat16)
    expected = NATIVE.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    got = grouped_fused_moe(x, w13, w2, weights, ids, NATIVE.silu_and_mul)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)
