"""The fused CPU kernel (csrc/w8a8_linear.cpp: AVX-512 VNNI bodies, or AVX2 ones, csrc/w8a8_avx2.h)
against the torch path it replaces.

The kernel does the torch path's operations in the same order (per-token scale, true
division, round half to even, the exact int32 product, two float32 products, the bias), so
the test asks for the same bits, not a tolerance: with both of its products (its own VNNI
tiles (VNNI only), torch._int_mm between its quantizing and scaling passes, its panels packed per call,
and the panels a loaded layer packs once and keeps in place of its weight), on odd shapes (M = 1,
7, 64; K not a multiple of the tiles' 64-byte step nor of 16; N not a multiple of their
4 rows nor of the scaling pass's 16 lanes), in each activation dtype, with and without a
bias, and with weights using all of int8 (-128 too, which a checkpoint may hold: the AVX2 body's
largest pair of products, 2 * 128 * 127, just fits its int16 sums). A CPU with neither skips it
(the torch path then runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.linear import Linear, load_weight, process_weights_after_loading
from tokenmill_quant_int8.config import Int8W8A8Config
from tokenmill_quant_int8.cpu_kernel import load_w8a8_kernel
from tokenmill_quant_int8.kernels import (
    cpu_kernel_runs,
    w8a8_linear_cpu,
    w8a8_linear_packed_cpu,
    w8a8_linear_torch,
    w8a8_pack_panels_cpu,
)


def _expected_isa() -> str:
    """The body the kernel builds for on this CPU (with -march=native), by its /proc/cpuinfo flags."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(next((line for line in text.splitlines() if line.startswith("flags")), "").partition(":")[2].split())
    if {"avx512_vnni", "avx512bw", "avx512vl"} <= flags:
        return "avx512_vnni"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "none"


EXPECTED_ISA = _expected_isa()
pytestmark = pytest.mark.skipif(EXPECTED_ISA == "none", reason="neither AVX-512 VNNI nor AVX2 on this CPU")
# the products the build has: the VNNI body's row-major tiles, then both bodies' two
PRODUCTS = ["tiles", "int_mm", "panels"] if EXPECTED_ISA == "avx512_vnni" else ["int_mm", "panels"]
SHAPES = [(m, k, n) for m in (1, 7, 64) for k, n in ((50, 33), (64, 96), (200, 17), (1000, 6))]


def test_an_unknown_product_is_refused_by_name() -> None:
    weight = torch.ones(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="product must be 'auto', 'tiles', 'int_mm' or 'panels', not 'fast'"):
        w8a8_linear_cpu(torch.ones(1, 8), weight, torch.ones(4), weight.sum(dim=1, dtype=torch.int32), None, "fast")


def test_the_kernel_is_built_for_the_cpus_instruction_set() -> None:
    assert cpu_kernel_runs()
    assert load_w8a8_kernel().isa() == EXPECTED_ISA


@pytest.mark.skipif(EXPECTED_ISA == "avx512_vnni", reason="the VNNI body has the tiles")
def test_the_avx2_body_refuses_the_tiles_by_name_and_takes_the_panels_for_auto() -> None:
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(2, 40, generator=generator), torch.randint(-128, 128, (5, 40), generator=generator,
                                                                       dtype=torch.int8)
    scale, row_sum = torch.rand(5, generator=generator), weight.sum(dim=1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"this build \(avx2\) has no 'tiles' product"):
        w8a8_linear_cpu(x, weight, scale, row_sum, None, "tiles")
    assert torch.equal(w8a8_linear_cpu(x, weight, scale, row_sum, None, "auto"),
                       w8a8_linear_torch(x, weight, scale, None))


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_the_kernel_gives_the_torch_paths_bits(m: int, k: int, n: int, dtype: torch.dtype, product: str) -> None:
    generator = torch.Generator().manual_seed(m * 1000 + k + n)
    x = (torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 8).to(dtype)
    weight = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    scale = torch.rand(n, generator=generator) / 100
    row_sum = weight.sum(dim=1, dtype=torch.int32)
    for bias in (None, torch.randn(n, generator=generator).to(dtype)):
        ours = w8a8_linear_cpu(x, weight, scale, row_sum, bias, product)
        expected = w8a8_linear_torch(x, weight, scale, bias)
        assert ours.dtype == dtype and ours.shape == (m, n)
        assert torch.equal(ours, expected), (ours - expected).abs().max()


@pytest.mark.parametrize("product", PRODUCTS)
def test_zero_rows_and_saturated_products_are_exact(product: str) -> None:
    """An all-zero row (the smallest scale), and rows whose quantized values all sit at +-127
    against weights of +-127 and -128 (the VNNI tiles' largest products: K * 255 * 128 before the
    offset; the AVX2 body's largest pairs, 2 * 128 * 127 in int16)."""
    k, n = 4099, 9
    x = torch.zeros(3, k)
    x[1], x[2, ::2], x[2, 1::2] = 3.0, -5.0, 5.0
    weight = torch.full((n, k), 127, dtype=torch.int8)
    weight[::2] = -128
    scale = torch.full((n,), 0.5)
    row_sum = weight.sum(dim=1, dtype=torch.int32)
    ours = w8a8_linear_cpu(x, weight, scale, row_sum, None, product)
    assert torch.equal(ours, w8a8_linear_torch(x, weight, scale, None))
    assert not ours[0].any()
    exact = 127 * row_sum.double() * (3.0 / 127) * 0.5  # row 1: every value quantized to 127 at a step of 3 / 127
    torch.testing.assert_close(ours[1].double(), exact, rtol=1e-6, atol=0)


def test_a_quantized_linear_layer_runs_the_kernel_with_the_torch_paths_output() -> None:
    """The layer the checkpoint loader builds (merged q/k/v-like shards, a bias) takes the kernel
    and gives what the torch path gives on its loaded tensors."""
    generator = torch.Generator().manual_seed(5)
    sizes, k = [64, 32, 32], 96
    ctx = ModelBuildContext(hf_config=None, quant_config=Int8W8A8Config(serialized=False), prefix="model.layers.0.qkv",
                            params_dtype=torch.bfloat16)
    layer = Linear(k, sum(sizes), bias=True, ctx=ctx, output_partition_sizes=sizes)
    params = dict(layer.named_parameters())
    for shard, size in enumerate(sizes):
        load_weight(params["weight"], torch.randn(size, k, generator=generator).bfloat16(), shard)
    load_weight(params["bias"], torch.randn(sum(sizes), generator=generator).bfloat16())
    process_weights_after_loading(layer)  # quantizes the float weight (online), then packs it
    assert layer.quant_method.fused_cpu  # type: ignore[union-attr]
    scale = layer.weight_scale
    quantized = _unpacked(layer.weight, sum(sizes), k)
    for rows in (1, 3, 6, 7, 40):  # one register tile's rows, fewer, more, several tiles
        x = torch.randn(rows, 2, k, generator=generator).bfloat16()
        expected = w8a8_linear_torch(x.reshape(2 * rows, k), quantized, scale, layer.bias).reshape(rows, 2, sum(sizes))
        assert torch.equal(layer(x), expected)
    # the weight is the kernel's panels now, in place of the row-major copy: its bytes, in
    # whole panels of 64 rows by a multiple of 64 columns
    assert layer.weight.dtype == torch.int8 and layer.weight.numel() == 128 * 128  # 128 rows; K = 96 padded to 128


def _unpacked(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The row-major [n, k] weight back from its panels, in torch: panel p's word (k4, v, j) is
    row 64 p + 16 v + j's bytes 4 k4 .. 4 k4 + 3 (the layout the kernel documents)."""
    count, words = panels.shape[0], panels.shape[1]
    rows = panels.reshape(count, words, 4, 16, 4).permute(0, 2, 3, 1, 4).reshape(count * 64, words * 4)
    return rows[:n, :k]


def test_panels_packed_at_load_give_the_torch_paths_bits() -> None:
    """The product over panels packed once (what a loaded layer runs) on the odd shapes, for
    every register tile's row count (1 to 6) and past it, with and without a bias."""
    for m, k, n in [*SHAPES, (5, 64, 65), (6, 127, 64), (13, 1000, 130)]:
        generator = torch.Generator().manual_seed(m * 1000 + k + n)
        weight = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
        scale, row_sum = torch.rand(n, generator=generator) / 100, weight.sum(dim=1, dtype=torch.int32)
        panels = w8a8_pack_panels_cpu(weight)
        assert panels.shape == (-(-n // 64), -(-k // 64) * 16, 4, 64)
        assert torch.equal(_unpacked(panels, n, k), weight)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 8).to(dtype)
            for bias in (None, torch.randn(n, generator=generator).to(dtype)):
                ours = w8a8_linear_packed_cpu(x, panels, k, scale, row_sum, bias)
                assert torch.equal(ours, w8a8_linear_torch(x, weight, scale, bias)), (m, k, n, dtype)


def test_panels_of_another_shape_are_refused() -> None:
    """Panels hold K rounded up to 64, so the weight's own K comes with them and x must match it
    exactly (K = 120 against a weight of 100 would otherwise read the zero padding: a wrong answer)."""
    weight = torch.ones(70, 100, dtype=torch.int8)
    panels, scale, row_sum = w8a8_pack_panels_cpu(weight), torch.ones(70), weight.sum(dim=1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="x has 120 features, the weight 100"):
        w8a8_linear_packed_cpu(torch.ones(1, 120), panels, 100, scale, row_sum, None)
    with pytest.raises(RuntimeError, match="panels must be w8a8_pack_panels' packing of an int8 \\[70, 200\\] weight"):
        w8a8_linear_packed_cpu(torch.ones(1, 200), panels, 200, scale, row_sum, None)
    with pytest.raises(RuntimeError, match="weight_row_sum must be a contiguous int32 \\[N\\]"):
        w8a8_linear_packed_cpu(torch.ones(1, 100), panels, 100, scale, row_sum[:69], None)
