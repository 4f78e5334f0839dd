"""The Triton GGUF matmul against the torch reference (dequantise the block rows, then a float32
matmul), and its embedding lookup, for every type they read, on odd shapes (M = 1, 7; K = 2 or 3
blocks; N under and past a tile): on the CPU under ``TRITON_INTERPRET=1``, compiled for a Hopper GPU
without one (triton's ptxas), and on CUDA where a GPU is lent (``-m gpu``: the kernels, then tiny
GGUF Llamas' greedy tokens against transformers on their dequantised weights).

Legacy blocks are packed by ``gguf.quants.quantize`` (the real on-disk bytes); the K-quants, which
the gguf package cannot pack, by the tests' ``k_quantizer`` and as random bytes in their layout
(every scale, min and high bit field takes arbitrary values). The interpreted cases run in a child
pytest (:func:`tokenmill.testing.child.run_pytest_child`: the interpreter is read when triton is
first imported, and setting it here would leak into every later test)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from k_quantizer import quantize_k, random_k_blocks

from tokenmill_quant_gguf import kernels
from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, block_geometry, dequantize_rows
from tokenmill_quant_gguf.kernels import gguf_linear_reference
from tokenmill_quant_gguf.kquants import K_QUANTS
from tokenmill_quant_gguf.linear_method import block_parts

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TYPES = sorted(KEPT_QUANTIZED, key=int)
# (m, blocks of K, n, how the blocks are made): n = 37 is past one 32-wide tile, 5 under it.
SHAPES = [(1, 3, 37, "quantized"), (7, 2, 5, "quantized"), (7, 3, 37, "random")]
CASES = [(qtype, *shape) for qtype in TYPES for shape in SHAPES if shape[3] == "quantized" or qtype in K_QUANTS]


def case_id(value: object) -> str:
    return getattr(value, "name", str(value))


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
def test_the_interpreted_cases_pass_under_the_interpreter():
    from tokenmill.testing.child import run_pytest_child

    output = run_pytest_child(__file__, env={"TRITON_INTERPRET": "1"}, extra_args=["-k", "interpreted_kernel"])
    assert f"{len(CASES) + 4 + 1 + len(TYPES)} passed" in output, output[-2000:]  # matmuls, splits, parts, lookups


def block_rows(qtype: GGMLQuantizationType, rows: int, k: int, how: str, seed: int) -> torch.Tensor:
    """uint8 block rows ``[rows, bytes]`` of random weights: packed by the gguf package (legacy types) or
    the tests' K-quant packer (``"quantized"``), or random bytes in a K-quant's layout (``"random"``)."""
    if how == "random":
        return torch.from_numpy(random_k_blocks(rows, k, qtype, seed))
    values = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    packed = quantize_k(values, qtype) if qtype in K_QUANTS else quantize(values, qtype)
    return torch.from_numpy(np.ascontiguousarray(packed))


def _check(qtype: GGMLQuantizationType, m: int, blocks: int, n: int, how: str, device: str,
           splits: int | None = None) -> None:
    from tokenmill_quant_gguf.triton_kernels import gguf_linear_triton

    k = blocks * block_geometry(qtype)[0]
    qweight = block_rows(qtype, n, k, how, seed=m * n).to(device)
    generator = torch.Generator().manual_seed(blocks)
    x, bias = torch.randn(m, k, generator=generator).to(device), torch.randn(n, generator=generator).to(device)
    expected = gguf_linear_reference(x, qweight, qtype, k, bias)
    ours = gguf_linear_triton(x, qweight, qtype, k, bias, splits)
    # Only the summation order differs: float32 rounding of sums as large as the outputs (a wrong scale,
    # min, nibble or high bit would be off by a whole weight's share of them).
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize(("qtype", "m", "blocks", "n", "how"), CASES, ids=case_id)
def test_the_interpreted_kernel_is_the_torch_reference(qtype, m, blocks, n, how):
    _check(qtype, m, blocks, n, how, "cpu")


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q6_K], ids=case_id)
@pytest.mark.parametrize("splits", [2, 5])
def test_the_interpreted_kernel_splits_the_k_loop(qtype, splits):
    # 3 legacy blocks: steps 0-1 and 2 (5 splits give 3 of one step); 24 K-quant steps: 5 runs of 5, the last 4.
    _check(qtype, 7, 3, 37, "quantized", "cpu", splits)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
def test_the_interpreted_kernel_reads_each_part_of_a_merged_layer():
    # q/k in Q4_0 and v in Q8_0, end to end in one flat buffer: a part is a view at its byte offset.
    from tokenmill_quant_gguf.triton_kernels import gguf_linear_triton

    types, sizes, k = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0], [40, 24], 64
    rows = [block_rows(qtype, size, k, "quantized", seed)
            for seed, (qtype, size) in enumerate(zip(types, sizes, strict=True))]
    flat = torch.cat([part.reshape(-1) for part in rows])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    for part, expected_rows in zip(block_parts(types, sizes, k), rows, strict=True):
        torch.testing.assert_close(gguf_linear_triton(x, part.rows_of(flat), part.qtype, k),
                                   gguf_linear_reference(x, expected_rows, part.qtype, k), rtol=1e-5, atol=1e-4)


def _check_lookup(qtype: GGMLQuantizationType, device: str) -> torch.Tensor:
    """The kernel's rows of 1-d ids (repeated, out of order) against the reference's; returns the difference."""
    from tokenmill_quant_gguf.triton_kernels import gguf_embedding_triton

    dim = 2 * block_geometry(qtype)[0]
    table = block_rows(qtype, 45, dim, "random" if qtype in K_QUANTS else "quantized", seed=3).to(device)
    ids = torch.tensor([44, 0, 7, 7, 31, 2, 40, 33, 19, 5, 8, 12, 0, 1, 3, 38, 21, 22, 9, 30, 11, 13, 14, 15, 16,
                        17, 18, 20, 23, 24, 25, 26, 27, 28], device=device)  # 34 lookups: past one 32-wide tile
    assert gguf_embedding_triton(table, ids[:0], qtype, dim).shape == (0, dim)
    return gguf_embedding_triton(table, ids, qtype, dim) - dequantize_rows(table[ids], qtype, dim)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("qtype", TYPES, ids=case_id)
def test_the_interpreted_kernel_looks_up_the_reference_rows(qtype):
    assert torch.equal(_check_lookup(qtype, "cpu"), torch.zeros(34, 2 * block_geometry(qtype)[0]))


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU, which the interpreter does not")
def test_the_kernels_compile_for_a_hopper_gpu_without_one():
    # The interpreter runs the kernels as numpy: a construct only the GPU compiler refuses (a type or
    # layout tl.dot cannot take, a constexpr branch it cannot resolve) shows only here or on a GPU.
    pytest.importorskip("triton.backends.nvidia")  # triton's CUDA backend, with the ptxas it ships
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tokenmill_quant_gguf.triton_kernels import BLOCK_M, BLOCK_N, _gguf_matmul, _gguf_rows

    def assembled(kernel, pointers: dict[str, str], scalars: tuple[str, ...], constants: dict[str, int],
                  **options: object) -> bytes:
        signature = {**pointers, **dict.fromkeys(scalars, "i32"), **dict.fromkeys(constants, "constexpr")}
        return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=options).asm["cubin"]

    for qtype, activations in [(qtype, "*fp32") for qtype in TYPES] + [(GGMLQuantizationType.Q4_K, "*bf16")]:
        blocks = {"QTYPE": int(qtype), "BLOCK_BYTES": block_geometry(qtype)[1]}
        assert assembled(_gguf_matmul, {"x_ptr": activations, "w_ptr": "*u8", "out_ptr": "*fp32"},
                         ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_os", "steps_per_split"),
                         {**blocks, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}), qtype.name
        assert assembled(_gguf_rows, {"w_ptr": "*u8", "ids_ptr": "*i64", "out_ptr": "*fp32"},
                         ("R", "stride_wn", "stride_or"), {**blocks, "BLOCK_R": BLOCK_N}, enable_fp_fusion=False)


def test_the_k_loop_is_split_only_where_the_output_tiles_leave_the_gpu_idle(monkeypatch):
    from tokenmill_quant_gguf import triton_kernels

    monkeypatch.setattr(triton_kernels, "_multiprocessors", lambda device: 132)  # an H100 / H200
    cuda = torch.device("cuda")
    assert triton_kernels.k_splits(1, 4096, 128, cuda) == 5  # 128 tiles: 640 programs of 26 steps (K 4096)
    assert triton_kernels.k_splits(1, 4096, 24, cuda) == 3  # each split keeps 8 steps at the least
    assert triton_kernels.k_splits(1, 4096, 7, cuda) == 1
    assert triton_kernels.k_splits(1, 151936, 128, cuda) == 1  # a vocabulary's tiles are enough
    assert triton_kernels.k_splits(512, 4096, 128, cuda) == 1  # as are prefill's


def test_every_kept_type_takes_the_triton_kernel_on_cuda_and_says_so(caplog):
    kernels.gpu_kernel.cache_clear()
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        chosen = {qtype: kernels.gpu_kernel(qtype) for qtype in TYPES + TYPES}  # the second time from the cache
    assert set(chosen.values()) == {"triton"}
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [f"GGUF {qtype.name} layers on cuda: the Triton kernel (blocks dequantised in registers "
                     "inside the matmul)" for qtype in TYPES]


@pytest.mark.parametrize(("qtype", "m", "blocks", "n", "how"),
                         CASES + [(qtype, 64, 8, 300, "quantized") for qtype in TYPES], ids=case_id)  # 300: 10 tiles
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_kernel_is_the_torch_reference(qtype, m, blocks, n, how):
    _check(qtype, m, blocks, n, how, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", TYPES, ids=case_id)
def test_the_cuda_kernel_looks_up_the_reference_rows(qtype):
    assert torch.equal(_check_lookup(qtype, "cuda"), torch.zeros(34, 2 * block_geometry(qtype)[0], device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("mix", "tied"), [("Q4_0", False), ("Q5_0", False), ("Q5_1", True), ("mixed", False),
                                           ("Q4_K_M", False), ("Q5_K", True)])
def test_tiny_llamas_on_cuda_generate_like_transformers_on_their_dequantised_weights(tmp_path: Path, mix: str,
                                                                                      tied: bool):
    from quant_agreement import agreement_with_transformers, greedy_with_logprobs
    from test_gguf_kquant_model import MIXES as K_MIXES
    from test_gguf_kquant_model import k_quant_llama
    from test_gguf_loader import tiny_model, write_llama_cpp_gguf
    from test_gguf_quantized_model import MIXES, PROMPTS, dequantised_reference

    path = tmp_path / f"tiny-{mix}.gguf"
    if mix in K_MIXES:
        k_quant_llama(path, mix, tied)
    else:
        legacy = {**MIXES, "Q5_0": lambda name: GGMLQuantizationType.Q5_0,
                  "Q5_1": lambda name: GGMLQuantizationType.Q5_1}
        write_llama_cpp_gguf(tiny_model("llama", tied=tied), path, "llama", legacy[mix])
    completions, logprobs = greedy_with_logprobs(path, PROMPTS, 12)  # the CUDA platform: the Triton kernel
    agreement = agreement_with_transformers(dequantised_reference(path, tmp_path / "reference"), PROMPTS,
                                            completions, logprobs)
    assert agreement.fraction >= 0.95, agreement
    assert agreement.max_logprob_error < 1e-3, agreement
