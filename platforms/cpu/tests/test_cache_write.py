"""Writing new K/V rows into the paged cache, against index_copy_ (the reference backend's way)."""

from __future__ import annotations

import pytest
import torch

from tokenmill_platform_cpu.kernels import kernels_available, load_kernels

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernels")
KV_HEADS, HEAD_SIZE, BLOCKS, BLOCK_SIZE = 4, 64, 64, 16


def _fused_projection(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the model hands them over: strided views into one qkv output."""
    kv = KV_HEADS * HEAD_SIZE
    qkv = torch.randn(tokens, 2 * kv + 2 * kv).to(dtype)
    return qkv[:, 2 * kv : 3 * kv].view(tokens, KV_HEADS, HEAD_SIZE), qkv[:, 3 * kv :].view(tokens, KV_HEADS, HEAD_SIZE)


@pytest.mark.parametrize("tokens", [1, 64, 700])  # a decode row, a decode batch, a prefill chunk (threads)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_land_in_their_slots_and_nowhere_else(tokens, dtype):
    torch.manual_seed(tokens)
    key, value = _fused_projection(tokens, dtype)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE)[:tokens]
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    key_cache, value_cache = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected_k.view(-1, KV_HEADS, HEAD_SIZE).index_copy_(0, slots, key)
    expected_v.view(-1, KV_HEADS, HEAD_SIZE).index_copy_(0, slots, value)
    load_kernels().write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_bad_slots_and_shapes_are_refused_without_writing():
    kernels = load_kernels()
    key, value = _fused_projection(2, torch.float32)
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_kv_cache(key, value, key_cache, value_cache, torch.tensor([0, BLOCKS * BLOCK_SIZE]))
    with pytest.raises(RuntimeError, match="matching the cache"):
        kernels.write_kv_cache(key[:, :2], value[:, :2], key_cache, value_cache, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.write_kv_cache(key.double(), value.double(), key_cache, value_cache, torch.tensor([0, 1]))
    assert not key_cache.any() and not value_cache.any()
