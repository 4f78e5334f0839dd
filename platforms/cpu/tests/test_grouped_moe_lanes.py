"""The grouped MoE kernel's lane tiles (kernels/moe_lane_tiles.h: experts packed at load by
pack_moe_experts, 16 pair rows along the vector lanes) against the torch reference loop.

Odd shapes on purpose: hidden 45 is odd (a bfloat16 k-pair short, as the intermediate's 37
is) and not a whole 24-column down tile; 37 intermediate columns end in a partial 12-column
gate/up tile. Experts get 1 to 300 rows, so the lane tiles (6 rows and more), partial 16-row
blocks and the row-dot tiles (fewer rows) all run in one call. Tolerances as in
test_grouped_moe_kernel.py.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import NativeLayerOps
from tokenmill_platform_cpu.kernels import kernels_available, load_kernels
from tokenmill_platform_cpu.step_graph import active_kernels, capture_step_graph

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
NATIVE = NativeLayerOps()
EXPERTS, HIDDEN, INTER = 8, 45, 37


def _experts(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) / INTER**0.5).to(dtype)
    return w13, w2


def _routed(tokens: int, top_k: int, dtype: torch.dtype, experts_used: int = EXPERTS):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    scores = torch.rand(tokens, experts_used, generator=generator)
    weights, ids = torch.topk(torch.softmax(scores, -1), min(top_k, experts_used), dim=-1)
    return x, weights, ids


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [7, 64, 300])
def test_float32_on_packed_experts_matches_the_reference(tokens, top_k):
    w13, w2 = _experts(torch.float32)
    x, weights, ids = _routed(tokens, top_k, torch.float32)
    got = load_kernels().grouped_moe(x, w13, w2, weights, ids, packed=load_kernels().pack_moe_experts(w13, w2))
    torch.testing.assert_close(got, NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [7, 64, 300])
def test_bfloat16_on_packed_experts_within_its_rounding(tokens, top_k):
    w13, w2 = _experts(torch.bfloat16)
    x, weights, ids = _routed(tokens, top_k, torch.bfloat16)
    got = load_kernels().grouped_moe(x, w13, w2, weights, ids, packed=load_kernels().pack_moe_experts(w13, w2))
    assert got.dtype == torch.bfloat16
    expected = NATIVE.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_without_tokens_are_never_read_from_the_packed_copy(dtype):
    """Experts 3-7 get no rows: NaN in their packed tiles must not reach the output."""
    w13, w2 = _experts(dtype)
    x, weights, ids = _routed(64, 2, dtype, experts_used=3)
    expected = load_kernels().grouped_moe(x, w13, w2, weights, ids)
    w13[3:] = float("nan")
    w2[3:] = float("nan")
    got = load_kernels().grouped_moe(x, w13, w2, weights, ids, packed=load_kernels().pack_moe_experts(w13, w2))
    assert not torch.isnan(got).any()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_a_busy_expert_on_two_threads():
    """All 64 tokens' first expert is 5 (64 rows, four lane blocks), cut between two threads."""
    kernels = load_kernels()
    w13, w2 = _experts(torch.float32)
    x, weights, ids = _routed(64, 2, torch.float32)
    ids[:, 0] = 5
    ids[:, 1] = torch.where(ids[:, 1] == 5, 6, ids[:, 1])
    threads = kernels.pool_threads()
    kernels.set_pool_threads(2)
    try:
        got = kernels.grouped_moe(x, w13, w2, weights, ids, packed=kernels.pack_moe_experts(w13, w2))
    finally:
        kernels.set_pool_threads(threads)
    torch.testing.assert_close(got, NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_a_packed_copy_of_other_experts_is_an_error():
    kernels = load_kernels()
    w13, w2 = _experts(torch.float32)
    x, weights, ids = _routed(8, 2, torch.float32)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.grouped_moe(x, w13, w2, weights, ids, packed=kernels.pack_moe_experts(w13[:4], w2[:4]))


def test_a_step_graph_replays_the_routed_layer_on_packed_experts():
    kernels = load_kernels()
    w13, w2 = _experts(torch.float32)
    packed = kernels.pack_moe_experts(w13, w2)
    x, _, _ = _routed(64, 2, torch.float32)
    logits = torch.randn(64, EXPERTS)
    load = torch.zeros(EXPERTS, dtype=torch.int64)

    def layer() -> tuple[torch.Tensor, ...]:
        return (active_kernels(kernels).routed_moe(x, logits, w13, w2, 2, True, load, packed=packed),)

    graph, (out,) = capture_step_graph(kernels, layer, kernels.GraphPool(64), 64)
    assert len(graph) == 1
    x.copy_(torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(5)))
    graph.replay()
    weights, ids = kernels.moe_route(logits, 2, True)
    torch.testing.assert_close(out, NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deepseek_routed_layer_runs_its_packed_experts(monkeypatch, dtype):
    """Grouped sigmoid top-k with a correction bias and a scaling factor is routed outside the
    kernel (select_experts), then runs on the packed experts (prepared_fused_moe): the layer packs
    them although its routing does not run in one op, and gives the reference's output."""
    from tokenmill.layers import FusedMoE, ModelBuildContext, MoERouting, select_experts
    from tokenmill.layers import ops as layer_ops_module
    from tokenmill_platform_cpu.layer_ops import CpuLayerOps

    ops = CpuLayerOps(load_kernels(), packed_budget=1 << 40)
    if dtype not in {getattr(torch, name) for name in load_kernels().grouped_moe_dtypes()}:
        pytest.skip(f"this build has no grouped MoE kernel for {dtype}")
    monkeypatch.setitem(layer_ops_module._BY_DEVICE_TYPE, "cpu", ops)
    routing = MoERouting(top_k=2, scoring="sigmoid", renormalize=True, num_groups=4, top_groups=2, scaling_factor=2.5,
                         correction_bias=True)
    layer = FusedMoE(EXPERTS, HIDDEN, INTER, routing,
                     ctx=ModelBuildContext(hf_config=None, params_dtype=dtype, prefix="model.layers.1.mlp.experts"))
    w13, w2 = _experts(dtype)
    layer.load_checkpoint_tensor("gate_up_proj", w13)
    layer.load_checkpoint_tensor("down_proj", w2)
    layer.load_checkpoint_tensor("e_score_correction_bias", torch.randn(EXPERTS, generator=torch.Generator().manual_seed(3)))
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[attr-defined]
    assert not layer.routes_in_one_op() and layer.prepared_experts is not None
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    logits = torch.randn(64, EXPERTS, generator=torch.Generator().manual_seed(5))
    calls = []
    real = ops.prepared_fused_moe
    monkeypatch.setattr(ops, "prepared_fused_moe", lambda *args: calls.append(1) or real(*args))
    with torch.no_grad():
        got = layer(x, logits)
    weights, ids = select_experts(logits, routing, layer.e_score_correction_bias)
    expected = NATIVE.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert calls == [1]
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
