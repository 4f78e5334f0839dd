"""The CPU platform's grouped MoE kernel (kernels/grouped_moe.cpp) against the torch reference
loop, its softmax top-k routing against tokenmill.layers' select_experts, and its step-graph form.

Tolerances: float32 differs from the reference only by the order of its sums (dot products of
at most 48 terms here, summed in vector lanes, then the k pairs): a few float32 ulps of the
terms' magnitude, so 1e-5 on outputs of order one. bfloat16 is compared with the float32
reference on the same (bfloat16) weights: both the kernel and the bfloat16 reference round the
matmul outputs and h to bfloat16 (relative 2^-8 each), hence 3e-2, as for the grouped path.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import NativeLayerOps
from tokenmill.layers.moe_routing import MoERouting, select_experts
from tokenmill.plugin_api import StepGraphUnsupported
from tokenmill_platform_cpu.kernels import kernels_available, load_kernels
from tokenmill_platform_cpu.step_graph import active_kernels, capture_step_graph

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
NATIVE = NativeLayerOps()
# Sizes that leave tails everywhere: 48 hidden is three float32 vectors but one and a half
# bfloat16 ones; 37 intermediate columns end in half a gate/up tile and a short down row.
EXPERTS, HIDDEN, INTER = 8, 48, 37


def _experts(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) / INTER**0.5).to(dtype)
    return w13, w2


def _routed(tokens: int, top_k: int, dtype: torch.dtype, experts_used: int = EXPERTS, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    scores = torch.rand(tokens, experts_used, generator=generator)
    weights, ids = torch.topk(torch.softmax(scores, -1), min(top_k, experts_used), dim=-1)
    return x, weights, ids


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_float32_matches_the_reference(tokens, top_k):
    """300 tokens at top-8: every expert gets 300 rows, past the kernel's 64-row blocks."""
    w13, w2 = _experts(torch.float32)
    x, weights, ids = _routed(tokens, top_k, torch.float32)
    got = load_kernels().grouped_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_experts_without_tokens_are_never_read(tokens):
    """Only experts 0-2 are routed to: 3-7, NaN here, must not reach the output."""
    w13, w2 = _experts(torch.float32)
    x, weights, ids = _routed(tokens, 2, torch.float32, experts_used=3)
    expected = NATIVE.fused_moe(x, w13, w2, weights, ids)
    w13[3:] = float("nan")
    w2[3:] = float("nan")
    got = load_kernels().grouped_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_bfloat16_within_its_rounding(tokens, top_k):
    w13, w2 = _experts(torch.bfloat16)
    x, weights, ids = _routed(tokens, top_k, torch.bfloat16)
    got = load_kernels().grouped_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    expected = NATIVE.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


def test_one_expert_with_most_tokens_on_two_threads():
    """The work is cut by (expert, column block), so the busy expert is split between the
    threads: the result must not depend on how."""
    kernels = load_kernels()
    w13, w2 = _experts(torch.float32)
    x, weights, ids = _routed(64, 2, torch.float32)
    ids[:, 0] = 5  # every token's first expert
    ids[:, 1] = torch.where(ids[:, 1] == 5, 6, ids[:, 1])
    expected = NATIVE.fused_moe(x, w13, w2, weights, ids)
    threads = kernels.pool_threads()
    kernels.set_pool_threads(2)
    try:
        got = kernels.grouped_moe(x, w13, w2, weights, ids)
    finally:
        kernels.set_pool_threads(threads)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_an_expert_id_out_of_range_is_an_error():
    w13, w2 = _experts(torch.float32)
    x, weights, ids = _routed(4, 2, torch.float32)
    ids[2, 1] = EXPERTS
    with pytest.raises(RuntimeError, match="expert id 8"):
        load_kernels().grouped_moe(x, w13, w2, weights, ids)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_routing_matches_select_experts(top_k, renormalize):
    logits = torch.randn(64, EXPERTS, generator=torch.Generator().manual_seed(3))
    weights, ids = load_kernels().moe_route(logits, top_k, renormalize)
    expected_weights, expected_ids = select_experts(logits, MoERouting(top_k=top_k, renormalize=renormalize))
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_layer_counts_the_load_and_runs_the_experts(dtype):
    w13, w2 = _experts(dtype)
    x, _, _ = _routed(7, 2, dtype)
    logits = torch.randn(7, EXPERTS, generator=torch.Generator().manual_seed(4)).to(dtype)
    load = torch.full((EXPERTS,), 5, dtype=torch.int64)
    got = load_kernels().routed_moe(x, logits, w13, w2, 2, True, load)
    weights, ids = select_experts(logits, MoERouting(top_k=2, renormalize=True))
    # the same experts on weights within an ulp of the kernel's routing (its own softmax)
    torch.testing.assert_close(got, load_kernels().grouped_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)
    assert torch.equal(load, 5 + torch.bincount(ids.reshape(-1), minlength=EXPERTS))


def test_a_step_graph_replays_the_routed_layer_on_new_inputs():
    kernels = load_kernels()
    w13, w2 = _experts(torch.float32)
    x, _, _ = _routed(5, 2, torch.float32)
    logits = torch.randn(5, EXPERTS)
    load = torch.zeros(EXPERTS, dtype=torch.int64)

    def layer() -> tuple[torch.Tensor, ...]:  # as the layer ops call it: on the graph while it captures
        return (active_kernels(kernels).routed_moe(x, logits, w13, w2, 2, False, load),)

    graph, (out,) = capture_step_graph(kernels, layer, kernels.GraphPool(8), 5)
    assert len(graph) == 1
    for seed in range(2):
        generator = torch.Generator().manual_seed(10 + seed)
        x.copy_(torch.randn(5, HIDDEN, generator=generator))
        logits.copy_(torch.randn(5, EXPERTS, generator=generator))
        graph.replay()
        weights, ids = select_experts(logits, MoERouting(top_k=2))
        torch.testing.assert_close(out, NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert int(load.sum()) == 3 * 5 * 2  # the capture's own run and two replays


def test_a_failed_capture_puts_the_expert_load_back():
    """A capture that fails after a MoE layer reruns its step eagerly, which counts the
    step's pairs again: the capture's own count must be undone."""
    kernels = load_kernels()
    w13, w2 = _experts(torch.float32)
    x, _, _ = _routed(3, 2, torch.float32)
    load = torch.full((EXPERTS,), 7, dtype=torch.int64)

    def layer_then_torch() -> tuple[torch.Tensor, ...]:
        out = active_kernels(kernels).routed_moe(x, torch.randn(3, EXPERTS), w13, w2, 2, True, load)
        return (torch.sigmoid(out),)  # computed in torch: not replayable

    with pytest.raises(StepGraphUnsupported):
        capture_step_graph(kernels, layer_then_torch, kernels.GraphPool(8), 3)
    assert torch.equal(load, torch.full((EXPERTS,), 7, dtype=torch.int64))
