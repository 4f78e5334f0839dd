"""The Triton fused MoE against the torch reference: on the CPU through Triton's
interpreter, and on a CUDA GPU (``-m gpu``) where one is.

The interpreter has to be on (``TRITON_INTERPRET=1``) before triton is first imported
(torch imports it too), so without it in the environment one test reruns this file's
interpreted cases in a child pytest that has it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenmill.layers import NativeLayerOps

pytest.importorskip("triton")
NATIVE = NativeLayerOps()
EXPERTS, HIDDEN, INTER = 8, 48, 40  # not multiples of the tiles: the masks are exercised


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
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
    assert "13 passed" in child.stdout, child.stdout[-2000:]  # 12 shapes and the experts-without-tokens case


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
    sorted_pairs, block_experts = interpreted.align_to_blocks(ids, EXPERTS)
    assert block_experts.tolist() == [0, 1, 2]  # 14 pairs over 3 experts: one block of 16 each
    assert sorted(p for p in sorted_pairs.tolist() if p < 14) == list(range(14))
    torch.testing.assert_close(interpreted.triton_fused_moe(x, w13, w2, weights, ids),
                               NATIVE.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


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
