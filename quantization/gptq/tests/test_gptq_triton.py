"""The Triton packed-int matmul against the torch path, on odd shapes (M = 1, 7, 64; K not a
multiple of the group or of the block; act-order): on the CPU under ``TRITON_INTERPRET=1``
(set here before triton is imported), and on CUDA where a GPU is lent (``-m gpu``)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: the kernel is then interpreted on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill_quant_gptq.kernels import dequantized_linear, gptq_dequantize, pack_rows

triton_kernels = pytest.importorskip("tokenmill_quant_gptq.triton_kernels")

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
    ours = triton_kernels.packed_int_linear_triton(x, qweight, zeros, scales, g_idx, bits, bias)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run needs triton's interpreter")
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
