"""The GGUF kernel's quantised-activation path (``activations="q8"``, ``"q8x2"``, ``"q8x3"``; AVX-512 VNNI).

The activations are quantised to 8-bit blocks of 32 (and, with ``q8x2`` / ``q8x3``, a second / third
plane for the previous one's rounding error at 1/128 of its scale), then multiplied as integers.
Three checks:

- the quantised activations themselves, value for value: multiplied by an identity matrix in
  each block type (one weight 1 per row, built by hand in the type's layout), the kernel
  returns exactly the reference's quantised x (:func:`quantised_activations`: the same
  float32 operations in the same order), zero blocks and an odd block count included;
- the product, against the reference's quantised x times the dequantised weights in float64,
  within float32 rounding of the sum's magnitude (``FLOAT_SLACK``: a product is two float32
  roundings, a lane accumulates at most K / 64 of them, then four reduction levels and the
  bias: well under 32 roundings of 2^-24);
- the product against the float32 product of the unquantised x, within the worst case of the
  quantisation: every value off by at most half a step, ``|W| @ (step / 2)``.

Weights are random values packed by the gguf package (llama.cpp's own packing).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf_kernels import packed

from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, dequantize_rows
from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel
from tokenmill_quant_gguf.kernels import gguf_linear
from tokenmill_quant_gguf.kquants import K_QUANTS

Q = GGMLQuantizationType
Q8_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
TYPES = sorted(KEPT_QUANTIZED, key=int)
KERNEL = load_cpu_kernel()
FLAGS = set(re.findall(r"\w+", Path("/proc/cpuinfo").read_text())) if Path("/proc/cpuinfo").exists() else set()
requires_vnni = pytest.mark.skipif(KERNEL is None or "avx512_vnni" not in FLAGS,
                                   reason="needs the GGUF CPU kernel built on a CPU with AVX-512 VNNI")
FLOAT_SLACK = 1e-6
PLANES = {"q8": 1, "q8x2": 2, "q8x3": 3}


def quantised_activations(x: torch.Tensor, planes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel multiplies for float32 ``x [M, K]``: the quantised values (float64,
    exact) and each value's step (the scale of its block's last plane)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) * (torch.tensor(1.0) / 127.0)
    inverse = torch.where(d == 0, torch.zeros_like(d), torch.tensor(1.0) / d)
    residual, step, value = blocks, d, torch.zeros_like(blocks, dtype=torch.float64)
    for plane in range(planes):
        q = torch.round(residual * (inverse * 128.0**plane)).clamp(-127, 127)
        value = 128.0 * value + q.double()
        if plane + 1 < planes:  # what this plane left, rounded once (the kernel's FMA)
            residual = (residual.double() - step.double() * q.double()).float()
            step = step / 128.0
    values = step.double() * value
    return values.reshape(m, k), step.expand_as(blocks).reshape(m, k).double()


def identity_blocks(k: int, qtype: GGMLQuantizationType) -> torch.Tensor:
    """``[k, bytes]`` rows of ``qtype`` that dequantise to the k x k identity (scale 1, min 0)."""
    one = np.float16(1.0).tobytes()
    zero = np.float16(0.0).tobytes()
    rows = []
    for j in range(k):
        row = b""
        for b in range(k // 32):
            q = np.full(32, {Q.Q4_0: 8, Q.Q5_0: 16}.get(qtype, 0), dtype=np.int64)  # the value of a zero weight
            if b == j // 32:
                q[j % 32] += 1
            if qtype == Q.Q8_0:
                row += one + q.astype(np.int8).tobytes()
                continue
            nibbles = bytes(int(q[i] & 15) | int(q[i + 16] & 15) << 4 for i in range(16))
            high = sum(int(q[i] >> 4 & 1) << i for i in range(32)).to_bytes(4, "little")
            row += {Q.Q4_0: one + nibbles, Q.Q4_1: one + zero + nibbles, Q.Q5_0: one + high + nibbles,
                    Q.Q5_1: one + zero + high + nibbles}[qtype]
        rows.append(np.frombuffer(row, dtype=np.uint8))
    return torch.from_numpy(np.stack(rows))


def product(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLQuantizationType, activations: str,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.tokenmill_gguf.matmul(x, qweight, int(qtype), x.shape[1], bias, activations)


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("activations", ["q8", "q8x2", "q8x3"])
@requires_vnni
def test_the_kernel_quantises_the_activations_as_the_reference(qtype: GGMLQuantizationType, activations: str) -> None:
    k = 96  # three blocks: the last of a row pairs with zeros
    identity = identity_blocks(k, qtype)
    assert torch.equal(dequantize_rows(identity, qtype, k), torch.eye(k))
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(3)) * 3
    x[:, 32:64] = 0  # a zero block: scale 0
    x[2, :32] = 1e-3 * x[2, :32]
    values, _ = quantised_activations(x, PLANES[activations])
    assert torch.equal(product(x, identity, qtype, activations), values.float())


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("activations", ["q8", "q8x2", "q8x3"])
@pytest.mark.parametrize("m", [1, 7, 31])  # from 32 rows on the op multiplies by a GEMM (below)
@requires_vnni
def test_the_product_is_the_quantised_activations_times_the_weights(qtype: GGMLQuantizationType, activations: str,
                                                                    m: int) -> None:
    n, k = 37, 13 * 32  # an odd row count (tiles of 4) and an odd block count
    qweight = packed(n, k, qtype, seed=m)
    weight = dequantize_rows(qweight, qtype, k).double()
    generator = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=generator), torch.randn(n, generator=generator)
    got = product(x, qweight, qtype, activations, bias).double()
    values, step = quantised_activations(x, PLANES[activations])
    expected = values @ weight.T + bias.double()
    magnitude = values.abs() @ weight.abs().T + bias.abs().double()
    assert ((got - expected).abs() <= FLOAT_SLACK * magnitude).all()
    # against the float product: each value within half a step of x
    float_product = x.double() @ weight.T + bias.double()
    bound = (step / 2) @ weight.abs().T + FLOAT_SLACK * magnitude
    assert ((got - float_product).abs() <= bound).all()


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("activations", ["q8", "q8x3"])
@requires_vnni
def test_a_decode_row_of_many_tiles_is_the_quantised_activations_times_the_weights(
        qtype: GGMLQuantizationType, activations: str) -> None:
    # One row of x (a batch-1 decode step) against a weight of decode proportions: a long row (48 blocks:
    # every pair full), many tiles of 4 weight rows with a partial last one, whose scales (and mins)
    # the kernel gathers a tile at a time; the product within float32 rounding of the float64 one.
    n, k = 4 * 25 + 3, 48 * 32
    qweight = packed(n, k, qtype, seed=5)
    weight = dequantize_rows(qweight, qtype, k).double()
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)) * 4
    got = product(x, qweight, qtype, activations).double()
    values, _ = quantised_activations(x, PLANES[activations])
    magnitude = values.abs() @ weight.abs().T
    assert ((got - values @ weight.T).abs() <= FLOAT_SLACK * magnitude).all()


@requires_vnni
def test_more_planes_come_within_float_tolerance_and_one_is_not() -> None:
    # The float path's test tolerance (test_gguf_kernels) holds from two planes on.
    qtype, k = Q.Q4_1, 13 * 32
    qweight = packed(37, k, qtype)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(0))
    expected = x @ dequantize_rows(qweight, qtype, k).T
    tolerance = {"rtol": 1e-4, "atol": 1e-4 * float(expected.abs().max())}
    for activations in ("q8x2", "q8x3"):
        torch.testing.assert_close(product(x, qweight, qtype, activations), expected, **tolerance)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(product(x, qweight, qtype, "q8"), expected, **tolerance)


@requires_vnni
def test_kernel_path_names_the_loop_each_type_takes() -> None:
    for qtype in Q8_TYPES:
        assert {KERNEL.kernel_path(int(qtype), activations) for activations in PLANES} == {"avx512_vnni"}
        assert KERNEL.kernel_path(int(qtype), "q8x3", 64) == "dequantize + gemm"
        assert KERNEL.kernel_path(int(qtype)) == KERNEL.kernel_path(int(qtype), "float32") != "avx512_vnni"
    assert KERNEL.kernel_path(int(Q.Q4_K), "q8x3") != "avx512_vnni"  # the K-quants keep the float path


@pytest.mark.skipif(KERNEL is None, reason="the GGUF CPU kernel did not build here")
def test_types_without_the_path_multiply_with_float_activations() -> None:
    qtype, k = Q.Q6_K, 512
    qweight = packed(9, k, qtype)
    x = torch.randn(3, k)
    assert torch.equal(product(x, qweight, qtype, "q8x3"), KERNEL.gguf_matmul(x, qweight, int(qtype), k))


@pytest.mark.skipif(KERNEL is None, reason="the GGUF CPU kernel did not build here")
@pytest.mark.parametrize("activations", ["float32", "q8x3"])
def test_the_out_overload_writes_what_the_functional_op_returns(activations: str) -> None:
    # The form the CPU platform's step graphs record: the result into a buffer of theirs.
    qtype, k = Q.Q4_0, 64
    qweight, bias = packed(11, k, qtype), torch.randn(11)
    x = torch.randn(5, k)
    out = torch.full((5, 11), float("nan"))
    returned = torch.ops.tokenmill_gguf.matmul.out(x, qweight, int(qtype), k, bias, activations, out=out)
    assert returned.data_ptr() == out.data_ptr()
    assert torch.equal(out, product(x, qweight, qtype, activations, bias))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        torch.ops.tokenmill_gguf.matmul.out(x, qweight, int(qtype), k, None, activations, out=torch.empty(5, 10))
    with pytest.raises(RuntimeError, match="activations must be"):
        product(x, qweight, qtype, "int4")


@pytest.mark.skipif(KERNEL is None, reason="the GGUF CPU kernel did not build here")
def test_linear_passes_its_activations_to_the_op() -> None:
    qtype, k = Q.Q8_0, 64
    qweight, bias = packed(6, k, qtype), torch.randn(6)
    x = torch.randn(2, 3, k)
    got = gguf_linear(x, qweight, qtype, k, bias, activations="q8x2")
    assert torch.equal(got.reshape(6, 6), product(x.reshape(6, k), qweight, qtype, "q8x2", bias))


@pytest.mark.skipif(KERNEL is None, reason="the GGUF CPU kernel did not build here")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("activations", ["float32", "q8x3"])
def test_many_rows_multiply_the_dequantised_weights_by_a_gemm(qtype: GGMLQuantizationType, activations: str) -> None:
    # From 32 rows on, whatever the activations say: panels of 256 weight rows dequantised, then
    # at::mm (N = 300: a full panel and a partial one). Within float32 summation error of the
    # float64 product: K * 2^-24 of the sum of the terms' magnitudes (the classic dot-product bound).
    m, n = 64, 300
    k = 3 * (256 if qtype in K_QUANTS else 32)
    qweight = packed(n, k, qtype, seed=1)
    weight = dequantize_rows(qweight, qtype, k).double()
    generator = torch.Generator().manual_seed(2)
    x, bias = torch.randn(m, k, generator=generator), torch.randn(n, generator=generator)
    assert KERNEL.kernel_path(int(qtype), activations, m) == "dequantize + gemm"
    got = product(x, qweight, qtype, activations, bias).double()
    expected = x.double() @ weight.T + bias.double()
    magnitude = x.double().abs() @ weight.abs().T + bias.abs().double()
    assert ((got - expected).abs() <= (k + 1) * 2**-24 * magnitude).all()
