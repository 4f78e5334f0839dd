"""The GGUF block dequantiser and the CPU kernel, against the ``gguf`` package and the torch reference.

Legacy blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are packed by ``gguf.quants.quantize``
(llama.cpp's own packing, ported by the gguf package), so the layouts under test are
the real on-disk ones; the SmolLM2 file's Q4_1 and Q8_0 tensors are checked too. The
gguf package cannot quantize the K-quants (Q4_K, Q5_K, Q6_K), so their blocks are
random bytes in the documented layout with finite float16 scales (every quant, 6-bit
scale and min, high bit takes arbitrary values), and the blocks of ``k_quantizer``.
On a CPU with AVX-512 every type runs the kernel's intrinsics path (the tests check that it
does, so the comparisons exercise it); the portable loop, the fallback elsewhere, is checked
against the same reference through ``gguf_matmul_portable``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from k_quantizer import quantize_k, random_k_blocks

from tokenmill_quant_gguf import default_model
from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, dequantize_rows, row_bytes
from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel
from tokenmill_quant_gguf.kernels import gguf_linear, gguf_linear_reference
from tokenmill_quant_gguf.kquants import K_QUANTS

TYPES = sorted(KEPT_QUANTIZED, key=int)
KERNEL = load_cpu_kernel()
requires_kernel = pytest.mark.skipif(KERNEL is None, reason="the GGUF CPU kernel did not build here")


def packed(rows: int, k: int, qtype: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """Blocks ``[rows, k]`` of ``qtype``: random weights packed by the gguf package, or for
    the K-quants (which it cannot pack) random bytes in their layout."""
    if qtype in K_QUANTS:
        return torch.from_numpy(random_k_blocks(rows, k, qtype, seed))
    values = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quantize(values, qtype)))


def features(qtype: GGMLQuantizationType, blocks: int) -> int:
    return blocks * (256 if qtype in K_QUANTS else 32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_dequantises_as_the_gguf_package_does(qtype: GGMLQuantizationType) -> None:
    k = features(qtype, 3)
    qweight = packed(19, k, qtype)
    expected = torch.from_numpy(dequantize(qweight.numpy(), qtype).reshape(19, k))
    assert torch.equal(dequantize_rows(qweight, qtype, k), expected)


@pytest.mark.parametrize("qtype", sorted(K_QUANTS, key=int), ids=lambda t: t.name)
def test_the_test_k_quantizer_packs_what_the_gguf_package_unpacks(qtype: GGMLQuantizationType) -> None:
    # Within a quantization step of the input: a field in a wrong place would be far off.
    values = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    qweight = torch.from_numpy(quantize_k(values, qtype))
    expected = torch.from_numpy(dequantize(qweight.numpy(), qtype).reshape(6, 512))
    assert torch.equal(dequantize_rows(qweight, qtype, 512), expected)
    bits = {GGMLQuantizationType.Q4_K: 4, GGMLQuantizationType.Q5_K: 5, GGMLQuantizationType.Q6_K: 6}[qtype]
    sub_block_range = float(values.max() - values.min())
    assert float((expected - torch.from_numpy(values)).abs().max()) < sub_block_range / 2**bits


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
# 9: a tile of 8 rows, then one (the one-row loop) in the same call; 5, 6, 7: the AVX2 loops' 4 rows, then 1, 2, 3
@pytest.mark.parametrize("m", [1, 5, 6, 7, 9, 64])
@pytest.mark.parametrize(("n", "blocks"), [(37, 13), (5, 1), (130, 3)])
@requires_kernel
def test_kernel_matches_the_torch_reference(qtype: GGMLQuantizationType, m: int, n: int, blocks: int) -> None:
    # 13 blocks (K = 416, or 3328 for the K-quants): not a multiple of 64 or of the kernel's 16-wide vectors
    # per row pair.
    k = features(qtype, blocks)
    qweight = packed(n, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    expected = gguf_linear_reference(x, qweight, qtype, k)
    got = KERNEL.gguf_matmul(x, qweight, int(qtype), k)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 7, 64])
@requires_kernel
def test_the_portable_loop_matches_the_torch_reference(qtype: GGMLQuantizationType, m: int) -> None:
    k = features(qtype, 13)
    qweight = packed(37, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expected = gguf_linear_reference(x, qweight, qtype, k)
    got = KERNEL.gguf_matmul_portable(x, qweight, int(qtype), k)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@requires_kernel
def test_every_type_takes_the_avx512_path_on_a_cpu_that_has_it() -> None:
    # The kernel is built with -march=native, so the build machine is this one.
    flags = set(re.findall(r"\w+", Path("/proc/cpuinfo").read_text())) if Path("/proc/cpuinfo").exists() else set()
    paths = {qtype.name: KERNEL.kernel_path(int(qtype)) for qtype in TYPES}
    if "avx512f" not in flags:
        assert "avx512" not in paths.values(), paths
        if {"avx2", "fma", "f16c"} <= flags:  # the legacy types' AVX2 loops; Q5 and the K-quants portable
            assert {paths[name] for name in ("Q4_0", "Q4_1", "Q8_0")} == {"avx2"}, paths
        pytest.skip("no AVX-512 here: the AVX2, portable and generic loops run (and are tested above)")
    assert set(paths.values()) == {"avx512"}, paths


@requires_kernel
def test_linear_takes_any_leading_shape_and_adds_the_bias() -> None:
    qweight = packed(11, 64, GGMLQuantizationType.Q4_1)
    x, bias = torch.randn(2, 3, 64), torch.randn(11)
    got = gguf_linear(x, qweight, GGMLQuantizationType.Q4_1, 64, bias)
    expected = gguf_linear_reference(x.reshape(6, 64), qweight, GGMLQuantizationType.Q4_1, 64, bias)
    assert got.shape == (2, 3, 11)
    torch.testing.assert_close(got.reshape(6, 11), expected, rtol=1e-4, atol=1e-4)


@requires_kernel
def test_kernel_refuses_rows_that_do_not_hold_the_features() -> None:
    qweight = packed(4, 64, GGMLQuantizationType.Q8_0)
    with pytest.raises(RuntimeError, match="do not hold 96 values"):
        KERNEL.gguf_matmul(torch.randn(1, 96), qweight, int(GGMLQuantizationType.Q8_0), 96)
    with pytest.raises(RuntimeError, match="has no kernel"):
        KERNEL.gguf_matmul(torch.randn(1, 64), qweight, int(GGMLQuantizationType.Q2_K), 64)


def test_features_that_are_not_whole_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="not a whole number of Q4_1 blocks"):
        row_bytes(GGMLQuantizationType.Q4_1, 48)


@pytest.mark.slow
@requires_kernel
def test_smollm2_tensors_dequantise_and_multiply_as_the_gguf_package_says() -> None:
    try:
        path = default_model.smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip(f"needs `{default_model.SMOLLM2_INSTALL}`")
    reader = GGUFReader(path)
    wanted = {"token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"}
    for tensor in (t for t in reader.tensors if t.name in wanted):
        qweight = torch.from_numpy(np.array(tensor.data))
        rows, k = qweight.shape[0], int(tensor.shape[0])
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(rows, k))
        assert torch.equal(dequantize_rows(qweight, tensor.tensor_type, k), expected), tensor.name
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
        got = KERNEL.gguf_matmul(x, qweight, int(tensor.tensor_type), k)
        torch.testing.assert_close(got, x @ expected.T, rtol=1e-4, atol=1e-4 * float(got.abs().max()), msg=tensor.name)
