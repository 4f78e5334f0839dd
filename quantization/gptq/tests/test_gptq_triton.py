"""The Triton packed-int matmul against the torch path, on odd shapes (M = 1, 7, 64; K not a
multiple of the group or of the block; act-order): on the CPU under ``TRITON_INTERPRET=1``, and on
CUDA where a GPU is lent (``-m gpu``).

The interpreter has to be on before triton is first imported, and in a whole test run another
module has imported it long before this one: the interpreted cases run in a child pytest with
``TRITON_INTERPRET=1``, started by one test here (setting the variable in this process would
also leak into every later test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenmill_quant_gptq.kernels import dequantized_linear, gptq_dequantize, pack_rows

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="this is the child run, or a GPU runs the kernel")
def test_the_interpreted_cases_pass_under_the_interpreter():
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                            "interpreted_kernel"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                           text=True)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert "27 passed" in child.stdout, child.stdout[-2000:]  # 9 shapes x 3 (bits, act-order) recipes


SHAPES = [(m, k, n, g) for m in (1, 7, 64) for k, n, g in ((80, 24, 32), (64, 40, 64), (136, 48, 128))]


def _layer(k: int, n: int, group: int, bits: int, act_order: bool, device: str):
    generator = torch.Generator().manual_seed(k * n + bits)
    groups = -(-k // group)
    q = torch.randint(0, 2 ** bits, (k, n), generator=generator, dtype=torch.int32)
    zeros = torch.randint(0, 2 ** bits, (groups, n), generator=generator, dtype=torch.int32)
    scales = torch.rand(groups, n, generator=generator) / 10
    g_idx = (torch.arange(k) // group).to(torch.int32)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    return [t.to(device) for t in (pack_rows(q, bits), zeros, scales, g_idx)]


def _check(m, k, n, group, bits, act_order, device):
    qweight, zeros, scales, g_idx = _layer(k, n, group, bits, act_order, device)
    generator = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=generator).to(device), torch.randn(n, generator=generator).to(device)
    expected = dequantized_linear(x, gptq_dequantize(qweight, zeros, scales, g_idx, bits), bias)
    from tokenmill_quant_gptq import triton_kernels

    ours = triton_kernels.packed_int_linear_triton(x, qweight, zeros, scales, g_idx, bits, bias)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize(("m", "k", "n", "group"), SHAPES)
@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, True)])
def test_the_interpreted_kernel_is_the_torch_path(m, k, n, group, bits, act_order):
    _check(m, k, n, group, bits, act_order, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("m", "k", "n", "group"), SHAPES)
@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, True)])
def test_the_cuda_kernel_is_the_torch_path(m, k, n, group, bits, act_order):
    _check(m, k, n, group, bits, act_order, "cuda")
