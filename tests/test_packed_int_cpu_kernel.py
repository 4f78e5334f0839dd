"""The packed-int CPU kernel (tokenmill/layers/csrc/packed_int_linear.cpp) against the torch path it replaces.

The reference is the dequantise-then-matmul definition (tokenmill.layers.dequantize_grouped, the
product in float64). The kernel dequantises the same integers exactly and sums in float32, so
the bound is the float32 accumulation's: a relative error of 1e-5 (the conformance kits' bound
for weight-only methods). Shapes: M = 1, 7, 64 and more (one pass of 8 rows, a partial
one, eight passes); N = 33 (a partial tile of 16 outputs); K = 200, a multiple of neither group size (the
last group partial, as GPTQ allows) and, for one group over all inputs, not a multiple of the
kernel's 8-position blocks. Act order: a shuffled g_idx (AutoGPTQ's) and an uneven one (groups
of any size, each padded on its own). With AVX512_VNNI, up to 8 rows of x take the integer path
(x rounded to int8 planes per row and group; bfloat16 / float16 x up to 8 rows, float32 up to 4):
M = 1 and 4 run it, 5 to 8 run it in half precision and the float path in float32, 9 and 64 the
float path (the AVX2 body, on a CPU without AVX-512, has only the float path: unpacked per 4 rows, and
dequantised once per tile from 8 rows on, which M = 8, 9 and 64 cross); its own test checks the planes'
stated bound input by input, with outliers, an
all-zero group and rows near float32's smallest normal. The layer tests check that GPTQ, AWQ and compressed-tensors
layers take the kernel, loaded from their on-disk tensors by the conformance kit's loader.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from awq_models import awq_config, dequantize, pack_awq
from awq_models import quantize as awq_quantize
from compressed_tensors_models import compress_weight, preset, quantization_config
from gptq_models import GptqRecipe, gptq_tensors
from gptq_models import quantize as gptq_quantize

from tokenmill.layers import (
    cpu_packed_int_linear,
    cpu_packed_int_weights,
    dequantize_grouped,
    pack_for_cpu,
    packed_int_integer_decode,
    packed_int_kernel_isa,
    packed_int_kernel_runs,
)
from tokenmill.testing.quantization import QuantizationConformance, QuantizedWeights, random_weight


def _cpu_has(*flags: str) -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(flag in text for flag in flags)


def _expected_isa() -> str:
    """What the kernel builds for here (-march=native): AVX-512 F/BW/VL bodies, else AVX2 ones."""
    if _cpu_has("avx512f", "avx512bw", "avx512vl"):
        return "avx512"
    return "avx2" if _cpu_has("avx2", "fma", "f16c") else "none"


pytestmark = pytest.mark.skipif(_expected_isa() == "none", reason="neither AVX-512 F/BW/VL nor AVX2 on this CPU")
K, N = 200, 33
CASES = [  # (bits, group_size, g_idx order, symmetric)
    (4, 32, "natural", False), (4, 128, "natural", True), (4, -1, "natural", False), (4, 32, "shuffled", False),
    (4, 32, "uneven", True), (8, 32, "natural", False), (8, -1, "natural", True), (8, 128, "shuffled", False),
]


def _layer_values(bits: int, group_size: int, order: str, symmetric: bool, k: int = K, seed: int = 0) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    g_idx = (torch.arange(k) // size).to(torch.int32)
    if order == "shuffled":
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    elif order == "uneven":
        g_idx = torch.randint(0, groups, (k,), generator=generator, dtype=torch.int32)
    top = 2 ** bits
    q = torch.randint(0, top, (k, N), generator=generator, dtype=torch.int32)
    zeros = torch.full((groups, N), top // 2, dtype=torch.int32) if symmetric else \
        torch.randint(0, top + 1, (groups, N), generator=generator, dtype=torch.int32)  # v1's +1 reaches 2**bits
    scales = torch.rand(groups, N, generator=generator) / top
    return q, zeros, scales, g_idx


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected).norm() / expected.norm())


def test_the_kernel_is_built_for_the_cpus_instruction_set() -> None:
    assert packed_int_kernel_runs()
    assert packed_int_kernel_isa().startswith(_expected_isa())


@pytest.mark.parametrize(("bits", "group_size", "order", "symmetric"), CASES)
def test_the_kernel_is_the_dequantised_product(bits: int, group_size: int, order: str, symmetric: bool) -> None:
    q, zeros, scales, g_idx = _layer_values(bits, group_size, order, symmetric)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    weights = pack_for_cpu(q, zeros, scales, g_idx, bits, bias)
    weight = dequantize_grouped(q, zeros, scales, g_idx).double()
    for m in (1, 4, 5, 7, 8, 9, 64):  # each side of the integer path's crossovers (VNNI: 4 and 8 rows)
        for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, torch.finfo(torch.bfloat16).eps)):
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(dtype)  # bfloat16: the pairs form
            out = cpu_packed_int_linear(x, weights)
            assert out.shape == (m, N) and out.dtype == dtype
            assert _relative_error(out, x.double() @ weight + bias.double()) <= bound


def test_decode_rows_take_the_integer_path_where_the_cpu_has_vnni_or_avx2() -> None:
    """AVX512_VNNI: 4- and 8-bit values; an AVX2 build (no AVX-512): 4-bit values by vpmaddubsw."""
    assert packed_int_integer_decode() == (_cpu_has("avx512_vnni") or _expected_isa() == "avx2")


def _largest_in_group(x: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """Each input's group's largest |x|, row by row: the scale of the row's int8 planes there."""
    largest = torch.zeros_like(x)
    for g in g_idx.unique():
        inputs = g_idx == g
        largest[:, inputs] = x[:, inputs].abs().amax(1, keepdim=True)
    return largest


@pytest.mark.skipif(not packed_int_integer_decode(), reason="no integer decode path: decode rows take the float path")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("dtype", "planes"), [(torch.float32, 3), (torch.bfloat16, 2), (torch.float16, 2)], ids=str)
def test_decode_rows_are_within_their_planes_rounding(bits: int, dtype: torch.dtype, planes: int) -> None:
    """The integer path's bound, input by input: each x within s / (2 * 254^(planes - 1)) of its
    planes, s = its group's largest |x| / 127; plus the output's rounding to x's dtype and the
    float32 sums. One plane fewer would be 254 times that and fails it (outliers make s large)."""
    q, zeros, scales, g_idx = _layer_values(bits, 32, "shuffled", False)
    weight = dequantize_grouped(q, zeros, scales, g_idx).double()
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(6))  # 4: float32's integer rows too
    x[:, 5] *= 1000  # an outlier input in every row
    x[:, g_idx == 1] = 0  # an all-zero group: a zero scale
    x[2] *= 1e-20
    x[3] = 0
    x = x.to(dtype).double()
    out = cpu_packed_int_linear(x.to(dtype), pack_for_cpu(q, zeros, scales, g_idx, bits)).double()
    expected = x @ weight
    planes_bound = (_largest_in_group(x, g_idx) / (127 * 2 * 254 ** (planes - 1))) @ weight.abs()
    rounding = torch.finfo(dtype).eps * expected.abs() + 1e-6 * (x.abs() @ weight.abs())
    assert torch.all((out - expected).abs() <= planes_bound + rounding)
    assert torch.equal(out[3], torch.zeros(N, dtype=torch.float64))


def test_decode_rows_near_the_smallest_float_stay_finite() -> None:
    """A group's later planes whose step is below float32's smallest normal stay 0 (no infinite
    reciprocal times a zero remainder): the row keeps its first plane's precision."""
    q, zeros, scales, g_idx = _layer_values(4, 32, "natural", False)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(8)) * 1e-35  # s ~ 1e-37: later steps below 1.2e-38
    out = cpu_packed_int_linear(x, pack_for_cpu(q, zeros, scales, g_idx, 4))
    assert torch.isfinite(out).all()
    assert _relative_error(out, x.double() @ dequantize_grouped(q, zeros, scales, g_idx).double()) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_nan_in_a_decode_row_reaches_its_outputs(dtype: torch.dtype) -> None:
    """As in the float product, one NaN input makes its row's outputs NaN (the integer path's planes
    would round it to a finite value) and leaves the other rows finite."""
    q, zeros, scales, g_idx = _layer_values(4, 32, "natural", False)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(9)).to(dtype)
    x[1, K // 3] = float("nan")
    out = cpu_packed_int_linear(x, pack_for_cpu(q, zeros, scales, g_idx, 4))
    assert torch.isnan(out[1]).all()
    assert torch.isfinite(out[0]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_activations_are_rounded_once(dtype: torch.dtype) -> None:
    """x is read as it is (bfloat16 by pairs of inputs, float16 widened to float32) and the float32
    result rounded to x's dtype: within one rounding."""
    q, zeros, scales, g_idx = _layer_values(4, 32, "shuffled", False)
    weights = pack_for_cpu(q, zeros, scales, g_idx, 4)
    x = torch.randn(2, 5, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = cpu_packed_int_linear(x, weights)
    assert out.shape == (2, 5, N) and out.dtype == dtype
    expected = x.double() @ dequantize_grouped(q, zeros, scales, g_idx).double()
    assert _relative_error(out, expected) <= torch.finfo(dtype).eps


def test_the_out_overload_writes_into_its_buffer() -> None:
    """The step graphs' form of the call: ``.out`` into a given buffer, returning it."""
    q, zeros, scales, g_idx = _layer_values(8, 32, "natural", False)
    w = pack_for_cpu(q, zeros, scales, g_idx, 8)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(4))
    out = torch.full((3, N), float("nan"))
    got = torch.ops.tokenmill_packed_int.packed_int_linear.out(x, w.packed, w.scales, w.zeros, w.x_index,
                                                               w.group_start, 8, N, None, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, cpu_packed_int_linear(x, w))


def test_two_bit_values_stay_on_the_torch_path() -> None:
    q, zeros, scales, g_idx = _layer_values(4, 32, "natural", False)
    assert cpu_packed_int_weights(q % 4, zeros % 4, scales, g_idx, 2, None, "test") is None


def _kit(method: str, config: dict[str, Any], make: Callable[[torch.Tensor], QuantizedWeights]) -> QuantizationConformance:
    """The conformance kit's layer builder for one method, its on-disk tensors made by `make`."""
    def make_weights(self: QuantizationConformance, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        return make(random_weight(out_features, in_features, seed))
    kit = type("Kit", (QuantizationConformance,), {"method": method, "quantization_config": config,
                                                   "make_weights": make_weights})
    return kit()  # type: ignore[no-any-return]


def _gptq(recipe: GptqRecipe) -> QuantizationConformance:
    def make(weight: torch.Tensor) -> QuantizedWeights:
        order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(7)) if recipe.desc_act else None
        layer = gptq_quantize(weight, recipe, order)
        return QuantizedWeights(gptq_tensors(layer, recipe), layer.dequantized())
    return _kit("gptq", recipe.config(), make)


def _awq(weight: torch.Tensor) -> QuantizedWeights:
    q, zeros, scales = awq_quantize(weight, 32)
    return QuantizedWeights({"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales},
                            dequantize(q, zeros, scales, 32))


def _compressed_tensors() -> QuantizationConformance:
    scheme = preset("W4A16_ASYM", group_size=32)

    def make(weight: torch.Tensor) -> QuantizedWeights:
        return QuantizedWeights(*compress_weight(weight, scheme, "pack-quantized"))
    return _kit("compressed-tensors", quantization_config(scheme, "pack-quantized"), make)


KITS = {"gptq-4bit-act-order": lambda: _gptq(GptqRecipe(desc_act=True)),
        "gptq-8bit-sym-v2": lambda: _gptq(GptqRecipe(bits=8, sym=True, checkpoint_format="gptq_v2")),
        "awq": lambda: _kit("awq", awq_config(32), _awq),
        "compressed-tensors-w4a16-asym": _compressed_tensors}


@pytest.mark.parametrize("name", list(KITS))
def test_each_method_runs_its_layers_on_the_kernel(name: str) -> None:
    kit = KITS[name]()
    shards = [kit.make_weights(48, 96, 0), kit.make_weights(40, 96, 1)]  # a merged layer; 88 outputs: 6 tiles
    bias = torch.randn(88, generator=torch.Generator().manual_seed(2))
    layer = kit.build_layer(96, shards, torch.float32, bias)
    assert layer.quant_method.cpu_weights is not None  # type: ignore[union-attr]
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(5))
    expected = x.double() @ torch.cat([part.dequantized for part in shards]).double().t() + bias.double()
    assert _relative_error(layer(x), expected) <= 1e-5
