"""The FP8 weight-only CPU kernel against its torch reference (the weight dequantised to float32,
then a float32 matmul): every fp8 code widened as torch widens it, odd shapes (M = 1, 7, 64; K and
N odd), per-channel and block-wise scales, float32 and bfloat16 activations, the out overload."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill_quant_fp8 import cpu_kernel
from tokenmill_quant_fp8.cpu_kernel import (
    choose_cpu_kernel,
    cpu_kernel_refusal,
    fp8_cpu_linear,
    fp8_weight_only_reference,
    kernel_scales_per_block,
    load_fp8_cpu_kernel,
)

pytestmark = pytest.mark.skipif(load_fp8_cpu_kernel() is None, reason="the FP8 CPU kernel does not build here")

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(m, k, n) for m in (1, 7, 64) for k, n in ((50, 33), (64, 96), (203, 17))]


def _every_code(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)


def _random_weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random finite codes of every magnitude (subnormals and the largest values included)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    return _finite(codes.view(dtype))


def _assert_within_summation_order(ours: torch.Tensor, expected: torch.Tensor, x: torch.Tensor,
                                   dequantised: torch.Tensor) -> None:
    """Two float32 sums of the same K products in other orders differ by at most about K units of
    float32 rounding (2**-24) of the sum of the products' magnitudes (fp8's range makes
    cancellations common, so no bound relative to the result would do)."""
    bound = x.shape[1] * 2 ** -23 * (x.abs() @ dequantised.abs().t()) + 1e-30
    assert ((ours - expected).abs() <= bound).all(), ((ours - expected).abs() / bound).max()


def _finite(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with its NaN (and e5m2's inf) codes replaced by zeros (fp8 has no masked_fill)."""
    codes = weight.view(torch.uint8).clone()
    codes[~weight.float().isfinite()] = 0
    return codes.view(weight.dtype)


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_every_code_is_widened_as_torch_widens_it(dtype):
    """One output per code (weight [256, 1], x = [[1]], scale 1): the kernel's widening of each of
    the 256 codes, subnormals, zeros and e5m2's inf and NaN included, is torch's conversion. The
    e4m3fn NaN codes are the exception the kernel documents: such a weight is refused at load."""
    codes = _every_code(dtype).reshape(256, 1)
    widened = fp8_cpu_linear(torch.ones(1, 1), codes, torch.ones(256, 1), 1, None)[0]
    expected = codes.float()[:, 0]
    nan = expected.isnan()
    assert torch.equal(widened[~nan], expected[~nan])
    if dtype == torch.float8_e5m2:
        assert widened[nan].isnan().all()
    else:
        assert nan.sum() == 2 and cpu_kernel_refusal(codes) is not None and "NaN" in cpu_kernel_refusal(codes)
        assert cpu_kernel_refusal(_finite(codes)) is None


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_per_channel_scales_match_the_reference(m, k, n, dtype):
    torch.manual_seed(m + k + n)
    weight = _random_weight(n, k, dtype, seed=k * n)
    scales = (torch.rand(n, 1) + 0.05) * 2 ** -6
    x, bias = torch.randn(m, k), torch.randn(n)
    ours = fp8_cpu_linear(x, weight, scales, k, bias)
    reference = fp8_weight_only_reference(x, weight, scales, k, bias)
    assert ours.shape == (m, n) and ours.dtype == torch.float32
    _assert_within_summation_order(ours, reference, x, weight.float() * scales)


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_block_scales_match_the_reference(m, k, n, block):
    rows, cols = block
    weight = _random_weight(n, k, torch.float8_e4m3fn, seed=k + n)
    block_scales = torch.rand(-(-n // rows), -(-k // cols), generator=torch.Generator().manual_seed(n)) + 0.01
    scales = kernel_scales_per_block(block_scales, rows, n)
    x = torch.randn(m, k)
    ours = fp8_cpu_linear(x, weight, scales, cols, None)
    dequantised = weight.float() * block_scales.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    expected = x @ dequantised.t()
    _assert_within_summation_order(ours, expected, x, dequantised)
    torch.testing.assert_close(fp8_weight_only_reference(x, weight, scales, cols, None), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [1, 7, 64])
def test_bfloat16_activations_come_back_in_bfloat16(m):
    weight = _random_weight(33, 203, torch.float8_e4m3fn, seed=m)
    scales = torch.rand(33, 1) * 2 ** -7
    x, bias = torch.randn(m, 203).bfloat16(), torch.randn(33)
    ours = fp8_cpu_linear(x, weight, scales, 203, bias)
    assert ours.dtype == torch.bfloat16
    # the float32 product rounded once into bfloat16 (the reference rounds the same sum)
    torch.testing.assert_close(ours, fp8_weight_only_reference(x, weight, scales, 203, bias), rtol=8e-3, atol=1e-2)


def test_the_out_overload_writes_the_functional_result():
    weight = _random_weight(17, 50, torch.float8_e4m3fn, seed=3)
    scales, x, bias = torch.rand(17, 2), torch.randn(7, 50), torch.randn(17)
    out = torch.full((7, 17), float("nan"))
    returned = torch.ops.tokenmill_fp8.fp8_linear.out(x, weight, scales, 32, bias, out=out)
    assert returned.data_ptr() == out.data_ptr()
    assert torch.equal(out, fp8_cpu_linear(x, weight, scales, 32, bias))


def test_operands_of_the_wrong_shape_are_refused():
    weight = _random_weight(17, 50, torch.float8_e4m3fn, seed=4)
    with pytest.raises(RuntimeError, match="scales must be a contiguous float32 \\[17, 2\\]"):
        fp8_cpu_linear(torch.randn(2, 50), weight, torch.rand(17, 1), 32, None)
    with pytest.raises(RuntimeError, match="weight must be float8_e4m3fn or float8_e5m2"):
        fp8_cpu_linear(torch.randn(2, 50), weight.float(), torch.rand(17, 1), 50, None)


def test_the_choice_is_logged_with_its_reason(caplog):
    cpu_kernel._chosen.cache_clear()  # logged once per process otherwise
    good = _random_weight(4, 8, torch.float8_e4m3fn, seed=5)
    bad = good.clone()
    bad.view(torch.uint8)[0, 0] = 0x7F
    with caplog.at_level(logging.INFO, logger="tokenmill_quant_fp8.cpu_kernel"):
        assert choose_cpu_kernel(good, "fp8")
        assert not choose_cpu_kernel(bad, "fp8")
    assert "fp8 linear layers on cpu: the weight-only CPU kernel" in caplog.text
    assert "not the weight-only CPU kernel (the weight holds NaN codes" in caplog.text
