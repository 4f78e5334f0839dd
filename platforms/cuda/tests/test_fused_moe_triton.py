"""The Triton fused MoE against the torch reference: on the CPU through Triton's
interpreter, and on a CUDA GPU (``-m gpu``) where one is.

The interpreter has to be on (``TRITON_INTERPRET=1``) before triton is first imported
(torch imports it too), so without it in the environment one test reruns this file's
interpreted cases in a child pytest that has it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.layers import (
    FusedMoE,
    MoERouting,
    NativeLayerOps,
    QuantizedFusedMoEOps,
    layer_ops,
    register_layer_ops,
    select_experts,
)

pytest.importorskip("triton")
NATIVE = NativeLayerOps()
EXPERTS, HIDDEN, INTER = 8, 48, 40  # not multiples of the tiles: the masks are exercised


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
QUANT_PLUGINS = all(importlib.util.find_spec(name) is not None for name in ("tokenmill_quant_fp8", "tokenmill_quant_int8"))
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


@pytest.fixture(scope="module")
def interpreted():
    from tokenmill_platform_cuda import fused_moe_triton

    return fused_moe_triton


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_the_interpreted_cases_pass_under_the_interpreter():
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                            "interpreted"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                           text=True)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    # 12 shapes, the experts-without-tokens case, 5 quantized cases, the alignment's blocks, and
    # the layer ops' float and quantized MoE (these two need the fp8/int8 plugins; counted when present)
    expected = 20 + 2 * QUANT_PLUGINS
    assert f"{expected} passed" in child.stdout, child.stdout[-2000:]


def _case(tokens: int, top_k: int, experts_used: int = EXPERTS, device: str = "cpu", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) / INTER**0.5
    weights, ids = torch.topk(torch.softmax(torch.rand(tokens, experts_used, generator=generator), -1), top_k, -1)
    return [t.to(device) for t in (x, w13, w2, weights, ids)]


@interpreted_only
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_interpreted_kernel_matches_the_reference(tokens, top_k, interpreted):
    x, w13, w2, weights, ids = _case(tokens, top_k)
    torch.testing.assert_close(interpreted.triton_fused_moe(x, w13, w2, weights, ids),
                               NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@interpreted_only
def test_interpreted_experts_without_tokens_get_no_block(interpreted):
    x, w13, w2, weights, ids = _case(7, 2, experts_used=3)
    sorted_pairs, block_experts = interpreted.align_to_blocks(ids, EXPERTS, 16)
    # 14 pairs over 3 experts: one block of 16 each, the blocks the worst case would need after them idle
    assert [e for e in block_experts.tolist() if e >= 0] == [0, 1, 2]
    assert block_experts.tolist()[3:] == [-1] * (len(block_experts) - 3)
    assert sorted(p for p in sorted_pairs.tolist() if p < 14) == list(range(14))
    torch.testing.assert_close(interpreted.triton_fused_moe(x, w13, w2, weights, ids),
                               NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@interpreted_only
def test_interpreted_alignment_pads_each_expert_to_whole_blocks(interpreted):
    ids = torch.tensor([[3, 0], [3, 1], [3, 0]])  # expert 3 thrice, 0 twice, 1 once, 2 never
    sorted_pairs, block_experts = interpreted.align_to_blocks(ids, 4, 2)
    runs = [sorted_pairs[2 * b:2 * b + 2].tolist() for b in range(len(block_experts)) if block_experts[b] >= 0]
    assert [e for e in block_experts.tolist() if e >= 0] == [0, 1, 3, 3]
    assert runs == [[1, 5], [3, 6], [0, 2], [4, 6]]  # pair t*k+j, padded with num_pairs (6)


def _quantize_experts(weight: torch.Tensor, dtype: torch.dtype, per_expert: bool):
    """Symmetric per row (or one scale per expert) -> (quantized, scales [E, rows] or [E])."""
    limit = 448.0 if dtype == torch.float8_e4m3fn else 127.0
    amax = weight.abs().amax(dim=(1, 2) if per_expert else 2)
    scale = amax / limit
    scaled = weight / (scale[:, None, None] if per_expert else scale[..., None])
    quantized = (torch.round(scaled) if dtype == torch.int8 else scaled).clamp(-limit, limit).to(dtype)
    return quantized, scale


def _dequantized(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantized.float() * scale.reshape(scale.shape[0], -1, 1)


def _quantized_reference(x, w13, s13, w2, s2, weights, ids, quantize_rows):
    """The reference loop on dequantised weights, the activations rounded per row as the kernel
    rounds them (``quantize_rows``, None for unquantized activations)."""
    def through(rows):
        if quantize_rows is None:
            return rows
        quantized, scale = quantize_rows(rows)
        return quantized.float() * scale[:, None]

    deq13, deq2 = _dequantized(w13, s13), _dequantized(w2, s2)
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        tokens, slot = torch.where(ids == expert)
        hidden = NATIVE.silu_and_mul(through(x[tokens]) @ deq13[expert].T)
        out.index_add_(0, tokens, (through(hidden) @ deq2[expert].T) * weights[tokens, slot, None])
    return out


QUANTIZED_CASES = [  # (weight dtype, activations quantized, one scale per expert, tokens, top-k, experts used)
    (torch.float8_e4m3fn, True, False, 64, 2, EXPERTS),
    (torch.float8_e4m3fn, True, True, 7, 8, EXPERTS),
    (torch.float8_e4m3fn, False, False, 7, 2, 3),
    (torch.int8, True, False, 64, 2, EXPERTS),
    (torch.int8, True, True, 1, 1, EXPERTS),
]


@interpreted_only
@pytest.mark.parametrize(("dtype", "quantize_activations", "per_expert", "tokens", "top_k", "used"), QUANTIZED_CASES)
def test_interpreted_quantized_experts_match_dequantised_weights(dtype, quantize_activations, per_expert, tokens,
                                                                 top_k, used, interpreted):
    x, w13, w2, weights, ids = _case(tokens, top_k, experts_used=used)
    (q13, s13), (q2, s2) = _quantize_experts(w13, dtype, per_expert), _quantize_experts(w2, dtype, per_expert)
    rows = (lambda r: interpreted.quantize_per_row(r, dtype)) if quantize_activations else None
    expected = _quantized_reference(x, q13, s13, q2, s2, weights, ids, rows)
    got = interpreted.triton_fused_moe_quantized(x, q13, s13, q2, s2, weights, ids,
                                                 quantize_activations=quantize_activations)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.fixture
def cuda_layer_ops_on_cpu():
    """The CUDA platform's layer ops registered for CPU tensors (the interpreter runs its
    kernels there) for one test, the previous ops put back after."""
    from tokenmill_platform_cuda.layer_ops import CudaLayerOps

    previous = layer_ops(torch.device("cpu"))
    ops = CudaLayerOps()
    register_layer_ops("cpu", ops)
    yield ops
    register_layer_ops("cpu", previous)


@interpreted_only
def test_interpreted_layer_ops_run_float_experts_in_the_kernel(cuda_layer_ops_on_cpu, interpreted):
    x, w13, w2, weights, ids = _case(7, 2)
    got = cuda_layer_ops_on_cpu.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(got, interpreted.triton_fused_moe(x, w13, w2, weights, ids))  # the kernel ran
    torch.testing.assert_close(got, NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    x64 = x.double()  # a dtype the kernel does not take: the reference
    torch.testing.assert_close(cuda_layer_ops_on_cpu.fused_moe(x64, w13.double(), w2.double(), weights, ids),
                               NATIVE.fused_moe(x64, w13.double(), w2.double(), weights, ids))


@interpreted_only
@pytest.mark.skipif(not QUANT_PLUGINS, reason="needs the fp8 and int8 quantization plugins")
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_interpreted_quantized_moe_methods_run_in_the_grouped_kernel(scheme, cuda_layer_ops_on_cpu, interpreted):
    """``quantization="fp8"`` / ``"int8"`` experts on a device with the grouped kernel: the layer's
    output is the kernel's, and agrees with the methods' own loop (same roundings, another order)."""
    from tokenmill_quant_fp8.moe import Fp8OnlineMoEMethod
    from tokenmill_quant_int8.moe import Int8OnlineMoEMethod

    method = {"fp8": Fp8OnlineMoEMethod, "int8": Int8OnlineMoEMethod}[scheme]()
    layer = FusedMoE(EXPERTS, HIDDEN, INTER, MoERouting(top_k=2, renormalize=True), quant_method=method)
    _, w13, w2, _, _ = _case(1, 1)
    layer.load_checkpoint_tensor("gate_up_proj", w13)
    layer.load_checkpoint_tensor("down_proj", w2)
    method.process_weights_after_loading(layer)
    x, logits = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(3)), torch.randn(13, EXPERTS)
    assert isinstance(cuda_layer_ops_on_cpu, QuantizedFusedMoEOps)
    grouped = layer(x, logits)
    weights, ids = select_experts(logits, layer.routing)
    direct = cuda_layer_ops_on_cpu.quantized_fused_moe(x, layer.gate_up_proj, layer.gate_up_proj_scale,
                                                       layer.down_proj, layer.down_proj_scale, weights, ids)
    assert torch.equal(grouped, direct)
    register_layer_ops("cpu", NATIVE)  # the methods' loop
    looped = layer(x, logits)
    assert ((grouped - looped).norm() / looped.norm()).item() < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_gpu_kernel_matches_the_reference(tokens, dtype):
    from tokenmill_platform_cuda.fused_moe_triton import triton_fused_moe

    x, w13, w2, weights, ids = _case(tokens, 2, device="cuda")
    expected = NATIVE.fused_moe(x, w13, w2, weights, ids)
    got = triton_fused_moe(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("tokens", [7, 300])
def test_gpu_quantized_kernel_matches_dequantised_weights(tokens, dtype):
    """Realistic widths (hidden 1024, intermediate 512, 8 experts, top-2) on the GPU: against the
    reference on dequantised weights with unquantized activations, so within the rounding of the
    activations (a few percent of the output's scale)."""
    from tokenmill_platform_cuda.fused_moe_triton import triton_fused_moe_quantized

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 1024, generator=generator)
    w13 = torch.randn(EXPERTS, 1024, 1024, generator=generator) / 32
    w2 = torch.randn(EXPERTS, 1024, 512, generator=generator) / 512**0.5
    weights, ids = torch.topk(torch.softmax(torch.rand(tokens, EXPERTS, generator=generator), -1), 2, -1)
    (q13, s13), (q2, s2) = _quantize_experts(w13, dtype, False), _quantize_experts(w2, dtype, False)
    expected = NATIVE.fused_moe(x, _dequantized(q13, s13), _dequantized(q2, s2), weights, ids)
    cuda = [t.cuda() for t in (x.bfloat16(), q13, s13, q2, s2, weights, ids)]
    got = triton_fused_moe_quantized(*cuda).float().cpu()
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0.1, atol=0.05 * scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_at_realistic_widths_and_inside_a_cuda_graph():
    """Hidden 1024, intermediate 512, 8 experts, top-2 in bfloat16 against the float32 reference;
    then the same call captured in a CUDA graph (the alignment reads nothing back to the host)
    and replayed on new routing."""
    from tokenmill_platform_cuda.fused_moe_triton import triton_fused_moe

    generator = torch.Generator().manual_seed(2)
    x = torch.randn(64, 1024, generator=generator)
    w13 = torch.randn(EXPERTS, 1024, 1024, generator=generator) / 32
    w2 = torch.randn(EXPERTS, 1024, 512, generator=generator) / 512**0.5
    weights, ids = torch.topk(torch.softmax(torch.rand(64, EXPERTS, generator=generator), -1), 2, -1)
    expected = NATIVE.fused_moe(x, w13, w2, weights, ids)
    cx, c13, c2, cw, cids = (t.cuda() for t in (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids))
    scale = expected.abs().max().item()
    torch.testing.assert_close(triton_fused_moe(cx, c13, c2, cw, cids).float().cpu(), expected, rtol=3e-2,
                               atol=2e-2 * scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_fused_moe(cx, c13, c2, cw, cids)
    new_weights, new_ids = torch.topk(torch.softmax(torch.rand(64, EXPERTS, generator=generator), -1), 2, -1)
    cw.copy_(new_weights.cuda())
    cids.copy_(new_ids.cuda())
    graph.replay()
    torch.testing.assert_close(captured.float().cpu(), NATIVE.fused_moe(x, w13, w2, new_weights, new_ids),
                               rtol=3e-2, atol=2e-2 * scale)
