"""The GPTQ torch path on odd shapes (M = 1, 7, 64; K not a multiple of the group; act-order)
against a plain float32 product with the weights dequantised one element at a time."""

from __future__ import annotations

import pytest
import torch

from tokenmill_quant_gptq.kernels import (
    dequantized_linear,
    gptq_dequantize,
    pack_columns,
    pack_rows,
    unpack_columns,
    unpack_rows,
    values_per_word,
)

SHAPES = [(m, k, n, g) for m in (1, 7, 64) for k, n, g in ((80, 24, 32), (64, 40, 64), (200, 16, 128))]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpacking_inverts_packing(bits):
    torch.manual_seed(bits)
    values = torch.randint(0, 2 ** bits, (32, 16), dtype=torch.int32)
    assert torch.equal(unpack_rows(pack_rows(values, bits), bits), values)
    assert torch.equal(unpack_columns(pack_columns(values, bits), bits), values)
    word = pack_rows(values[: 32 // bits, :1], bits)[0, 0].item() & 0xFFFFFFFF
    assert word == sum(int(v) << (bits * j) for j, v in enumerate(values[: 32 // bits, 0]))


def test_unsupported_widths_are_refused():
    with pytest.raises(ValueError, match="3-bit packed weights"):
        values_per_word(3)


@pytest.mark.parametrize(("m", "k", "n", "group"), SHAPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_the_dequantised_linear_is_the_elementwise_definition(m, k, n, group, act_order):
    generator = torch.Generator().manual_seed(m * k + n)
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=generator, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, n), generator=generator, dtype=torch.int32)
    scales = torch.rand(groups, n, generator=generator) / 10
    g_idx = (torch.arange(k) // group).to(torch.int32)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    x, bias = torch.randn(m, k, generator=generator), torch.randn(n, generator=generator)
    expected = torch.empty(n, k, dtype=torch.float64)
    for kk in range(k):
        g = int(g_idx[kk])
        expected[:, kk] = (q[kk] - zeros[g]).double() * scales[g].double()
    weight = gptq_dequantize(pack_rows(q, 4), zeros, scales, g_idx, 4)
    torch.testing.assert_close(weight.double(), expected.t(), rtol=0, atol=1e-6)
    torch.testing.assert_close(dequantized_linear(x, weight, bias).double(), x.double() @ expected.t() + bias.double(),
                               rtol=1e-5, atol=1e-4)
