"""A NaN or inf that enters a kernel leaves it non-finite, in its own rows only.

Error isolation finds a broken request by the NaN or inf in its logits (the model
runner's ``_unsampleable_rows``): every kernel between a poisoned activation and the
logits must carry it through, which the compiler may not if it is told to assume
finite math (``-ffast-math`` alone). The other rows must stay finite, or one bad
request would fail the whole batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill_platform_cpu.kernels import kernels_available, load_kernels
from tokenmill_platform_cpu.layer_ops import CpuLayerOps
from tokenmill_platform_cpu.step_graph import capture_step_graph

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
POISONS = [math.nan, math.inf, -math.inf]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    return CpuLayerOps(load_kernels(), packed_budget=1 << 40)


def _poisoned(rows: int, width: int, poison: float, dtype: torch.dtype, row: int = 1) -> torch.Tensor:
    """Random rows, one value of ``row`` replaced by ``poison``."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    x[row, width // 3] = poison
    return x.to(dtype)


def _assert_only_row_broken(out: torch.Tensor, row: int = 1) -> None:
    finite = torch.isfinite(out.float()).reshape(out.shape[0], -1).all(dim=-1)
    assert not finite[row], "the poisoned row came out finite"
    assert finite[torch.arange(out.shape[0]) != row].all(), "a clean row came out non-finite"


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(ops, poison, dtype):
    x = _poisoned(4, 512, poison, dtype)
    _assert_only_row_broken(ops.rms_norm(x, torch.rand(512).to(dtype), 1e-6))


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_the_output_and_the_residual(ops, poison, dtype):
    x, residual = _poisoned(4, 512, poison, dtype), torch.randn(4, 512).to(dtype)
    out = ops.add_rms_norm(x, residual, torch.rand(512).to(dtype), 1e-6)
    _assert_only_row_broken(out)
    _assert_only_row_broken(residual)  # the next layer adds to it


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("half", ["gate", "up"])
def test_silu_and_mul(ops, poison, dtype, half):
    x = torch.randn(4, 2, 256)
    x[1, 0 if half == "gate" else 1, 7] = poison
    _assert_only_row_broken(ops.silu_and_mul(x.reshape(4, 512).to(dtype)))


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(ops, poison, dtype):
    angles = torch.rand(16, 32) * 10
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    q = _poisoned(4, 2 * 64, poison, dtype).view(4, 2, 64)
    k = _poisoned(4, 64, poison, dtype).view(4, 1, 64)
    got_q, got_k = ops.rotary(torch.tensor([0, 3, 5, 9]), q, k, cos, sin)
    _assert_only_row_broken(got_q)
    _assert_only_row_broken(got_k)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 5])  # the small-matmul kernel; the packed panels (float32), small (bfloat16)
def test_linear_as_the_lm_head(ops, poison, dtype, rows):
    weight = torch.randn(1000, 77).to(dtype)  # a short last panel, an odd K
    x = _poisoned(rows, 77, poison, dtype)
    _assert_only_row_broken(ops.linear(x, weight, None, ops.prepare_linear_weight(weight)))


@pytest.mark.parametrize("poison", POISONS)
def test_small_linear_kernel_itself(poison):
    """Whichever body this machine built, called directly (ops may route rows elsewhere)."""
    x = _poisoned(2, 512, poison, torch.float32)
    _assert_only_row_broken(load_kernels().small_linear(x, torch.randn(300, 512), None))


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head", [8, 64])  # the portable loops; the AVX-512 body
def test_paged_attention_of_a_poisoned_query(poison, dtype, head):
    """Three one-token requests on blocks of their own; the middle one's query is poisoned."""
    tokens, heads, kv_heads, block = 3, 4, 2, 4
    key_cache = torch.randn(8, block, kv_heads, head).to(dtype)
    value_cache = torch.randn(8, block, kv_heads, head).to(dtype)
    query = _poisoned(tokens, heads * head, poison, dtype).view(tokens, heads, head)
    table = torch.tensor([[0, 1], [2, 3], [4, 5]])
    out = load_kernels().paged_attention(query, key_cache, value_cache, table, torch.arange(tokens),
                                         torch.tensor([5, 6, 2]), head**-0.5, 0)
    _assert_only_row_broken(out)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_of_a_poisoned_cached_value(poison, dtype):
    """A request whose cache holds a bad value row: its own outputs break, not the others'."""
    head = 64
    key_cache = torch.randn(4, 4, 1, head).to(dtype)
    value_cache = torch.randn(4, 4, 1, head).to(dtype)
    value_cache[1, 2, 0, 10] = poison  # block 1 belongs to the second request only
    out = load_kernels().paged_attention(torch.randn(3, 2, head).to(dtype), key_cache, value_cache,
                                         torch.tensor([[0], [1], [2]]), torch.arange(3), torch.tensor([3, 3, 3]),
                                         head**-0.5, 0)
    _assert_only_row_broken(out)


@pytest.mark.parametrize("poison", POISONS)
def test_temperature_sample_draws_a_token_in_range_from_a_broken_row(poison):
    """The runner reports a non-finite row from the logits' max and drops its draw; the
    draw itself must still stay inside the vocabulary."""
    logits = _poisoned(3, 1000, poison, torch.float32)
    tokens = load_kernels().temperature_sample(logits, torch.full((3,), 0.7), torch.rand(3))
    assert ((0 <= tokens) & (tokens < 1000)).all()


@pytest.mark.parametrize("poison", POISONS)
def test_a_replayed_step_graph_carries_a_poisoned_row_to_the_logits(ops, poison):
    """Norm, then the lm_head, as the end of a decode step; replayed on poisoned input."""
    x, norm, lm_head = torch.randn(2, 64), torch.rand(64), torch.randn(500, 64)
    prepared = ops.prepare_linear_weight(lm_head)
    graph, (logits,) = capture_step_graph(
        load_kernels(), lambda: (ops.linear(ops.rms_norm(x, norm, 1e-6), lm_head, None, prepared),),
        load_kernels().GraphPool(8), 2)
    x.copy_(_poisoned(2, 64, poison, torch.float32))
    graph.replay()
    _assert_only_row_broken(logits)
