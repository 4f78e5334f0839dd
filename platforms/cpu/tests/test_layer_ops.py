"""The CPU platform's fused layer ops and matmul kernels against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.layers import NativeLayerOps
from tokenmill_platform_cpu.kernels import kernel_isa, kernels_available, load_kernels
from tokenmill_platform_cpu.layer_ops import PACKED_MAX_ROWS, PACKED_MIN_ROWS, CpuLayerOps

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
NATIVE = NativeLayerOps()


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    return CpuLayerOps(load_kernels(), packed_budget=1 << 40)


@pytest.mark.parametrize("shape", [(1, 512), (37, 768), (3, 5, 64), (0, 64)])
def test_rms_norm(ops, shape):
    torch.manual_seed(0)
    x, weight = torch.randn(shape) * 3, torch.randn(shape[-1])
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), NATIVE.rms_norm(x, weight, 1e-6))


def test_rms_norm_of_a_strided_view(ops):
    """Qwen3 normalises the heads of q, a view into the fused qkv output."""
    qkv = torch.randn(7, 3 * 4 * 64)
    q = qkv[:, : 4 * 64].view(7, 4, 64)
    weight = torch.randn(64)
    torch.testing.assert_close(ops.rms_norm(q, weight, 1e-5), NATIVE.rms_norm(q, weight, 1e-5))


@pytest.mark.parametrize("tokens", [1, 50])
def test_add_rms_norm_updates_the_residual(ops, tokens):
    torch.manual_seed(1)
    x, residual, weight = torch.randn(tokens, 512), torch.randn(tokens, 512), torch.randn(512)
    expected_residual = residual + x
    expected = NATIVE.rms_norm(expected_residual, weight, 1e-6)
    out = ops.add_rms_norm(x.clone(), residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("tokens", [1, 33])
def test_silu_and_mul(ops, tokens):
    x = torch.randn(tokens, 2 * 1536) * 4
    torch.testing.assert_close(ops.silu_and_mul(x), NATIVE.silu_and_mul(x))


@pytest.mark.parametrize("head_size", [64, 128, 6])
def test_rotary_in_place_on_qkv_views(ops, head_size):
    torch.manual_seed(2)
    tokens, heads, kv_heads, max_pos = 9, 4, 2, 64
    angles = torch.rand(max_pos, head_size // 2) * 10
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    positions = torch.randint(0, max_pos, (tokens,))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    expected_q, expected_k = NATIVE.rotary(positions, q.clone(), k.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_size :].clone()
    got_q, got_k = ops.rotary(positions, q, k, cos, sin)
    torch.testing.assert_close(got_q, expected_q)
    torch.testing.assert_close(got_k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], v_before)  # v untouched


# 8 and 11 also give the AVX2 body's 6-row tiles their tails of 2 and 5
@pytest.mark.parametrize("rows", [1, PACKED_MIN_ROWS, 7, 8, 9, 11, 64, 100, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(384, 256), (1000, 77)])  # (1000, 77): a short last panel, odd K
def test_packed_linear_matches_a_float64_reference_at_every_row_count(ops, rows, bias, shape):
    """Rows 3-256 run on the packed panels (whole tiles and every tail), the rest elsewhere."""
    torch.manual_seed(3)
    weight = torch.randn(*shape)
    b = torch.randn(shape[0]) if bias else None
    prepared = ops.prepare_linear_weight(weight)
    if prepared is None:
        pytest.skip("no AVX-512 body for the packed kernel on this CPU")
    x = torch.randn(rows, shape[1])
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(ops.linear(x, weight, b, prepared), expected, rtol=1e-5, atol=1e-4)


def test_packed_linear_keeps_leading_dimensions_and_reads_strided_rows(ops):
    weight = torch.randn(96, 64)
    prepared = ops.prepare_linear_weight(weight)
    if prepared is None:
        pytest.skip("no AVX-512 body for the packed kernel on this CPU")
    x = torch.randn(2, 10, 128)[..., ::2]  # [batch, tokens, features], every other feature
    got = ops.linear(x, weight, None, prepared)
    assert got.shape == (2, 10, 96)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [PACKED_MIN_ROWS, 7, 8, 64, PACKED_MAX_ROWS + 1, 700])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(384, 256), (1000, 77)])
def test_bfloat16_panels_take_every_row_count_where_they_are_built(ops, rows, bias, shape):
    """The AVX2 build packs bfloat16 weights too (torch's bfloat16 matmul is a scalar loop on such a
    CPU) and runs them from PACKED_MIN_ROWS rows up, prefill chunks included: float32 sums of
    widened weights, rounded once (so one bfloat16 rounding of the float64 reference)."""
    if torch.bfloat16 not in {getattr(torch, name) for name in load_kernels().packed_linear_dtypes()}:
        pytest.skip("this build leaves bfloat16 matmuls to torch (oneDNN)")
    torch.manual_seed(4)
    weight = torch.randn(*shape).bfloat16()
    b = torch.randn(shape[0]).bfloat16() if bias else None
    prepared = ops.prepare_linear_weight(weight)
    assert prepared is not None and prepared.dtype == torch.bfloat16
    x = torch.randn(rows, shape[1]).bfloat16()
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    got = ops.linear(x, weight, b, prepared)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, **_SMALL_LINEAR_TOLERANCE[torch.bfloat16])
    direct = load_kernels().packed_linear(x, prepared, shape[0], b)  # the kernel itself, not torch's matmul
    torch.testing.assert_close(direct.float(), expected, **_SMALL_LINEAR_TOLERANCE[torch.bfloat16])


def test_panels_of_another_dtype_are_refused():
    kernels = load_kernels()
    panels = kernels.pack_linear_weight(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="x and panels of one of packed_linear_dtypes"):
        kernels.packed_linear(torch.randn(4, 32).bfloat16(), panels, 64, None)
    with pytest.raises(RuntimeError, match="pack_linear_weight: a \\[N, K\\] weight of one of packed_linear_dtypes"):
        kernels.pack_linear_weight(torch.randn(64, 32).half())


def test_packed_linear_rejects_panels_of_another_shape():
    kernels = load_kernels()
    panels = kernels.pack_linear_weight(torch.randn(64, 32))  # two panels: 33 to 64 outputs
    with pytest.raises(RuntimeError, match="n does not match"):
        kernels.packed_linear(torch.randn(4, 32), panels, 100, None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        kernels.packed_linear(torch.randn(4, 16), panels, 64, None)


def test_other_dtypes_fall_back_to_the_reference(ops):
    x = torch.randn(5, 64, dtype=torch.float16)
    weight = torch.randn(64, dtype=torch.float16)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), NATIVE.rms_norm(x, weight, 1e-6))
    assert ops.prepare_linear_weight(torch.randn(8, 8, dtype=torch.float16)) is None
    if "bfloat16" not in load_kernels().packed_linear_dtypes():  # (the AVX2 build packs bfloat16 too)
        assert ops.prepare_linear_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("tokens", [1, 37])
def test_bfloat16_ops_round_the_float32_result_once(ops, tokens):
    """bfloat16 in, float32 arithmetic, one rounding out (the reference rounds between its ops)."""
    torch.manual_seed(4)
    x, residual = (torch.randn(tokens, 512) * 3).bfloat16(), torch.randn(tokens, 512).bfloat16()
    weight = torch.randn(512).bfloat16()
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6),
                               NATIVE.rms_norm(x.float(), weight.float(), 1e-6).bfloat16())
    summed = residual.clone()
    out = ops.add_rms_norm(x.clone(), summed, weight, 1e-6)
    assert torch.equal(summed, (residual.float() + x.float()).bfloat16())
    torch.testing.assert_close(out, NATIVE.rms_norm(summed.float(), weight.float(), 1e-6).bfloat16())
    gate_up = (torch.randn(tokens, 2 * 256) * 4).bfloat16()
    torch.testing.assert_close(ops.silu_and_mul(gate_up), NATIVE.silu_and_mul(gate_up.float()).bfloat16())
    angles = torch.rand(32, 32) * 10
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    positions = torch.randint(0, 32, (tokens,))
    qkv = torch.randn(tokens, 8 * 64).bfloat16()
    q, k = qkv[:, : 4 * 64].view(tokens, 4, 64), qkv[:, 4 * 64 : 6 * 64].view(tokens, 2, 64)
    expected_q, expected_k = NATIVE.rotary(positions, q.float(), k.float(), cos, sin)
    got_q, got_k = ops.rotary(positions, q, k, cos, sin)
    torch.testing.assert_close(got_q, expected_q.bfloat16())
    torch.testing.assert_close(got_k, expected_k.bfloat16())


def test_packing_stops_at_its_memory_budget():
    ops = CpuLayerOps(load_kernels(), packed_budget=3 * 64 * 64 * 4)
    packed = [ops.prepare_linear_weight(torch.randn(64, 64)) for _ in range(5)]
    assert [p is not None for p in packed] == [True, True, True, False, False]
    assert ops.prepare_linear_weight(torch.randn(8, 8)) is None  # the budget is spent


def test_packed_experts_take_from_the_same_budget():
    """The MoE lane tiles' packed copy of a layer's experts is charged like a linear layer's
    panels: a layer past what is left stays unpacked (the kernel's row-dot tiles run it)."""
    w13, w2 = torch.randn(4, 2 * 32, 64), torch.randn(4, 64, 32)
    ops = CpuLayerOps(load_kernels(), packed_budget=w13.nbytes + w2.nbytes + 64 * 64 * 4)
    if ops.prepare_moe_experts(w13, w2) is None:
        pytest.skip("this build has no grouped MoE kernel for float32")
    assert ops.prepare_moe_experts(w13, w2) is None  # the first copy left less than a second needs


# bfloat16 is compared after one rounding of the float32 result; float32 against float64
_SMALL_LINEAR_TOLERANCE = {torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-5}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7])  # 7: past the kernel (packed panels or torch's matmul)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [512, 77])  # 77: not a multiple of the kernel's vector steps
def test_small_linear_matches_a_wider_reference(ops, dtype, rows, bias, in_features):
    torch.manual_seed(5)
    # 300 outputs: not a multiple of the rows the float32 kernel reads side by side
    weight = torch.randn(300, in_features).to(dtype)
    b = torch.randn(300).to(dtype) if bias else None
    x = torch.randn(1, rows, in_features).to(dtype)  # [batch, tokens, features]: leading dims kept
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    got = ops.linear(x, weight, b, None)
    assert got.shape == (1, rows, 300) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, **_SMALL_LINEAR_TOLERANCE[dtype])
    if rows <= 6:  # the kernel itself, whichever body this machine built (ops may send these rows elsewhere)
        direct = load_kernels().small_linear(x[0], weight, b)
        torch.testing.assert_close(direct.float(), expected[0], **_SMALL_LINEAR_TOLERANCE[dtype])


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags from /proc/cpuinfo")
def test_matmul_kernels_have_the_vector_bodies_this_cpu_supports():
    """Guards the fallbacks: a build that lost a vector body would still pass the accuracy
    tests, only slowly (or, for the packed kernel, skip them)."""
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    dtypes = set(load_kernels().small_linear_dtypes())
    vector = "avx512f" in flags or {"avx2", "fma"} <= flags  # AVX-512 bodies, else AVX2+FMA ones
    assert ("float32" in dtypes) == vector
    assert ("bfloat16" in dtypes) == vector  # AVX512-BF16 dot products, else AVX2 widening loads
    assert load_kernels().packed_linear_available() == vector
    # bfloat16 panels where torch's own bfloat16 matmul has no vector kernel: an AVX2 CPU (or an
    # AVX2 build of the kernels, TOKENMILL_CPU_ISA=avx2, which stands for one)
    avx2_build = kernel_isa().split()[0] == "avx2"
    expected_packed = {"float32", "bfloat16"} if vector and avx2_build else {"float32"} if vector else set()
    assert set(load_kernels().packed_linear_dtypes()) == expected_packed
    # the grouped MoE kernel: AVX-512 float32 (bfloat16 with AVX512-BF16), or both in an AVX2 build
    level, native = kernel_isa().split()[0], kernel_isa().endswith("(native)")
    moe_bf16 = level in ("avx2", "avx512_bf16") or (native and {"avx512_bf16", "avx512bw"} <= flags)
    expected_moe = ({"float32", "bfloat16"} if moe_bf16 else {"float32"}) if vector else set()
    assert set(load_kernels().grouped_moe_dtypes()) == expected_moe
