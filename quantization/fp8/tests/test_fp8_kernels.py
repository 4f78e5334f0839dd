"""The FP8 kernels against their torch references, on odd shapes (M = 1, 7, 64; K not a
multiple of 16, N odd)."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill_quant_fp8 import kernels
from tokenmill_quant_fp8.kernels import (
    FP8_DTYPE,
    FP8_MAX,
    block_scales_per_row,
    choose_fp8_gemm,
    fp8_block_linear_reference,
    fp8_block_linear_scaled_mm,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_per_channel,
)

SHAPES = [(m, k, n) for m in (1, 7, 64) for k, n in ((50, 33), (64, 96), (200, 17))]


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_matches_the_reference(m, k, n, out_dtype):
    torch.manual_seed(m * k + n)
    xq, x_scale = quantize_per_token(torch.randn(m, k) * 3)
    weight, weight_scale = quantize_weight_per_channel(torch.randn(n, k))
    bias = torch.randn(n)
    ours = fp8_linear_scaled_mm(xq, x_scale, weight, weight_scale, bias, out_dtype)
    reference = fp8_linear_reference(xq, x_scale, weight, weight_scale, bias, out_dtype)
    assert ours.dtype == out_dtype and ours.shape == (m, n)
    # e4m3 products are exact in float32; only the summation order differs (and bf16's rounding of the result)
    tolerance = dict(rtol=1e-5, atol=1e-4) if out_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours, reference, **tolerance)


def test_the_reference_is_the_dequantised_product():
    torch.manual_seed(0)
    x, w = torch.randn(7, 50), torch.randn(33, 50)
    xq, x_scale = quantize_per_token(x)
    wq, w_scale = quantize_weight_per_channel(w)
    expected = (xq.float() * x_scale) @ (wq.float() * w_scale[:, None]).t()
    torch.testing.assert_close(fp8_linear_reference(xq, x_scale, wq, w_scale, None, torch.float32), expected)
    # and near the float product: each factor off by at most 2**-4 relative (about 2**-5 on average)
    assert (expected - x @ w.t()).norm() <= 0.05 * (x @ w.t()).norm()


def test_per_token_quantization_uses_the_whole_range_and_rounds_within_e4m3():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 3e3, -7.0]])
    xq, scale = quantize_per_token(x)
    assert xq.dtype == FP8_DTYPE and scale.shape == (3, 1)
    assert xq.float().abs().amax(dim=1).tolist() == [FP8_MAX, 0.0, FP8_MAX]
    back = xq.float() * scale
    assert not back.isnan().any()
    normal = x.abs() >= scale * 2 ** -6  # below e4m3's smallest normal the rounding is absolute
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2 ** -4).all()


def _block_product_by_loops(x, weight, scales, block):
    """Block-wise FP8 spelled out: each (row block, column block) of the weight with its scale,
    each token's column group with its own."""
    rows, cols = block
    out = torch.zeros(x.shape[0], weight.shape[0])
    for j in range(0, x.shape[1], cols):
        group = x[:, j:j + cols]
        g_scale = group.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        gq = (group / g_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * g_scale
        for i in range(0, weight.shape[0], rows):
            w_block = weight[i:i + rows, j:j + cols].float() * scales[i // rows, j // cols]
            out[:, i:i + rows] += gq @ w_block.t()
    return out


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_block_wise_reference_matches_the_blocks_spelled_out(m, k, n):
    torch.manual_seed(k + n)
    block = (16, 32)
    weight = (torch.randn(n, k) * 10).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scales = torch.rand(-(-n // block[0]), -(-k // block[1])) + 0.01
    x = torch.randn(m, k)
    bias = torch.randn(n)
    expected = _block_product_by_loops(x, weight, scales, block) + bias
    torch.testing.assert_close(fp8_block_linear_reference(x, weight, scales, block, bias), expected,
                               rtol=1e-5, atol=1e-4)
    row_scales = block_scales_per_row(scales, block[0], n)
    torch.testing.assert_close(fp8_block_linear_scaled_mm(x, weight, row_scales, block, bias), expected,
                               rtol=1e-5, atol=1e-4)


def test_group_quantization_pads_a_short_last_group():
    x = torch.randn(3, 50)
    xq, scale = quantize_per_token_group(x, 32)
    assert xq.shape == (3, 50) and scale.shape == (3, 2)
    torch.testing.assert_close(xq[:, 32:].float() * scale[:, 1:], x[:, 32:], rtol=2 ** -4, atol=1e-2)


def test_the_cpu_takes_scaled_mm_and_says_so(caplog):
    kernels._chosen.cache_clear()  # logged once per process otherwise
    with caplog.at_level(logging.INFO, logger="tokenmill_quant_fp8.kernels"):
        path = choose_fp8_gemm(torch.device("cpu"), 50, 33)
    assert path == "scaled_mm"  # torch 2.13's CPU build implements row-wise _scaled_mm
    assert "fp8 linear layers on cpu: scaled_mm path" in caplog.text
