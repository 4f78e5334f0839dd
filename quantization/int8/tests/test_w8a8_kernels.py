"""The INT8 W8A8 kernels against their torch reference, on odd shapes (M = 1, 7, 64; K not a
multiple of 16, N odd)."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill_quant_int8 import kernels
from tokenmill_quant_int8.kernels import (
    cuda_int_mm_takes,
    int8_matmul,
    int8_matmul_int_mm,
    int8_matmul_reference,
    int_mm_takes,
    quantize_per_token,
    quantize_weight_per_channel,
    scale_output,
)

SHAPES = [(m, k, n) for m in (1, 7, 64) for k, n in ((50, 33), (64, 96), (200, 17))]


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_int_mm_is_the_exact_integer_product(m, k, n):
    torch.manual_seed(m + k * n)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    exact = xq.long() @ weight.long().t()
    assert torch.equal(int8_matmul_reference(xq, weight).long(), exact)
    assert torch.equal(int8_matmul_int_mm(xq, weight).long(), exact)
    assert torch.equal(int8_matmul(xq, weight).long(), exact)


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_the_scaled_product_is_the_dequantised_product(m, k, n):
    torch.manual_seed(k + n)
    xq, x_scale = quantize_per_token(torch.randn(m, k) * 5)
    weight, weight_scale = quantize_weight_per_channel(torch.randn(n, k))
    bias = torch.randn(n)
    expected = (xq.double() * x_scale.double()) @ (weight.double() * weight_scale.double()[:, None]).t() + bias.double()
    ours = scale_output(int8_matmul(xq, weight), x_scale, weight_scale, bias, torch.float32)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=1e-5)


def test_per_token_quantization_rounds_to_half_a_step_and_saturates_nowhere():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.01], [0.0, 0.0, 0.0, 0.0], [1e-3, 3e3, -7.0, 2.9e3]])
    xq, scale = quantize_per_token(x)
    assert xq.dtype == torch.int8 and scale.shape == (3, 1)
    assert xq.abs().amax(dim=1).tolist() == [127, 0, 127]
    assert xq.min() >= -127  # symmetric: -128 unused
    assert ((xq.float() * scale - x).abs() <= scale / 2 + 1e-6).all()


def test_the_cpu_takes_int_mm_for_any_shape_and_cuda_small_batches_fall_back():
    assert int_mm_takes(torch.device("cpu"), 1, 50, 33)  # torch 2.13's CPU _int_mm has no shape rule
    assert cuda_int_mm_takes(64, 64, 96)
    assert not any(cuda_int_mm_takes(m, k, n) for m, k, n in ((1, 64, 96), (16, 64, 96), (64, 50, 96), (64, 64, 33)))


def test_the_chosen_path_is_logged_once(caplog):
    kernels._chosen.cache_clear()
    xq, weight = torch.ones(1, 50, dtype=torch.int8), torch.ones(33, 50, dtype=torch.int8)
    with caplog.at_level(logging.INFO, logger="tokenmill_quant_int8.kernels"):
        int8_matmul(xq, weight)
        int8_matmul(xq, weight)
    assert [r.getMessage() for r in caplog.records] == ["int8 W8A8 linear layers on cpu: torch._int_mm"]
