"""The GGUF block dequantiser and the CPU kernel, against the ``gguf`` package and the torch reference.

Blocks are packed by ``gguf.quants.quantize`` (llama.cpp's own packing, ported by the
gguf package), so the layouts under test are the real on-disk ones; the SmolLM2 file's
Q4_1 and Q8_0 tensors are checked too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from tokenmill_quant_gguf import default_model
from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, dequantize_rows, row_bytes
from tokenmill_quant_gguf.cpu_kernel import load_cpu_kernel
from tokenmill_quant_gguf.kernels import gguf_linear, gguf_linear_reference

TYPES = sorted(KEPT_QUANTIZED, key=int)
KERNEL = load_cpu_kernel()
requires_kernel = pytest.mark.skipif(KERNEL is None, reason="the GGUF CPU kernel did not build here")


def packed(rows: int, k: int, qtype: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """Random weights ``[rows, k]`` packed into ``qtype`` blocks by the gguf package."""
    values = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quantize(values, qtype)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_dequantises_as_the_gguf_package_does(qtype: GGMLQuantizationType) -> None:
    qweight = packed(19, 96, qtype)
    expected = torch.from_numpy(dequantize(qweight.numpy(), qtype).reshape(19, 96))
    assert torch.equal(dequantize_rows(qweight, qtype, 96), expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize(("n", "k"), [(37, 416), (5, 32), (130, 96)])
@requires_kernel
def test_kernel_matches_the_torch_reference(qtype: GGMLQuantizationType, m: int, n: int, k: int) -> None:
    # K = 416 is 13 blocks: not a multiple of 64 or of the kernel's 16-wide vectors per row pair.
    qweight = packed(n, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    expected = gguf_linear_reference(x, qweight, qtype, k)
    got = KERNEL.gguf_matmul(x, qweight, int(qtype), k)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


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
        KERNEL.gguf_matmul(torch.randn(1, 64), qweight, int(GGMLQuantizationType.Q4_K), 64)


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
