"""The CPU paged attention backend against a plain torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.layers import Attention
from tokenmill_platform_cpu import attention
from tokenmill_platform_cpu.attention import CpuPagedAttentionBackend, _decode_step_data, _step_data
from tokenmill_platform_cpu.kernels import kernels_available

needs_kernel = pytest.mark.skipif(not kernels_available(), reason="no C++ compiler to build the kernel")

BLOCK, HEADS, KV_HEADS = 4, 4, 2


def _reference(q_all, k_all, v_all, context, seq, window, head):
    """Attention of one request's new queries over its whole sequence, by the definition."""
    q = q_all.transpose(0, 1)
    k = k_all.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    v = v_all.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * head**-0.5
    qpos = torch.arange(context, seq)[:, None]
    kpos = torch.arange(seq)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= qpos - kpos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@needs_kernel
# 64 and 128 run the kernel's AVX-512 bodies, 8 its portable loops.
@pytest.mark.parametrize("head", [8, 64, 128])
@pytest.mark.parametrize("window", [None, 5])
# (tokens already cached, new tokens): decodes, a short chunk and long prefills; and a
# lone decode, which the kernel splits over KV heads to keep both threads busy; and a decode
# step of several requests (prepare's decode path)
@pytest.mark.parametrize("requests", [[(9, 1), (0, 13), (3, 1), (6, 20), (0, 1), (11, 4)], [(30, 1)],
                                      [(9, 1), (0, 1), (17, 1)]])
# bfloat16: rows widened in the kernel, arithmetic in float32, the output rounded once
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# these sequences are short enough that every query takes the kernel; with the limit at 0 the
# long queries take the SDPA paths instead (a whole prompt, and a chunk after a cached prefix)
@pytest.mark.parametrize("kernel_max_seq_len", [0, attention.KERNEL_MAX_SEQ_LEN])
def test_mixed_prefill_and_decode_batch_matches_reference(window, head, requests, dtype, kernel_max_seq_len,
                                                          monkeypatch):
    monkeypatch.setattr(attention, "KERNEL_MAX_SEQ_LEN", kernel_max_seq_len)
    torch.manual_seed(0)
    num_blocks = 64
    key_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, head, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    free = list(torch.randperm(num_blocks).tolist())
    tables, seq_keys, seq_values, slots = [], [], [], []
    for context, new in requests:
        seq = context + new
        blocks = [free.pop() for _ in range(-(-seq // BLOCK))]
        tables.append(blocks)
        keys, values = torch.randn(seq, KV_HEADS, head).to(dtype), torch.randn(seq, KV_HEADS, head).to(dtype)
        seq_keys.append(keys)
        seq_values.append(values)
        for pos in range(context):  # the cached part is already in the cache
            key_cache[blocks[pos // BLOCK], pos % BLOCK] = keys[pos]
            value_cache[blocks[pos // BLOCK], pos % BLOCK] = values[pos]
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(context, seq)]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query_lens = np.array([n for _, n in requests])
    query_start = np.concatenate([[0], np.cumsum(query_lens)])
    seq_lens = np.array([c + n for c, n in requests])
    metadata = AttentionMetadata(
        num_reqs=len(requests), num_actual_tokens=int(query_start[-1]), max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=BLOCK, query_start_loc=torch.from_numpy(query_start),
        seq_lens=torch.from_numpy(seq_lens), context_lens=torch.from_numpy(seq_lens - query_lens),
        block_table=table, slot_mapping=torch.tensor(slots), query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens)
    query = torch.randn(int(query_start[-1]), HEADS, head).to(dtype)
    new_keys = torch.cat([k[c:] for k, (c, _) in zip(seq_keys, requests, strict=True)])
    new_values = torch.cat([v[c:] for v, (c, _) in zip(seq_values, requests, strict=True)])

    backend = CpuPagedAttentionBackend()
    layer = Attention(HEADS, head, KV_HEADS, head**-0.5, sliding_window=window)
    metadata.backend_data = backend.prepare(metadata)
    sdpa_requests = [i for i, (context, new) in enumerate(requests)
                     if new > attention.KERNEL_MAX_QUERY_LEN and context + new > kernel_max_seq_len]
    assert [chunk.request for chunk in metadata.backend_data.chunks] == sdpa_requests
    out = backend.forward(layer, query, new_keys, new_values, (key_cache, value_cache), metadata)
    for i, (context, new) in enumerate(requests):
        s, e = query_start[i], query_start[i + 1]
        expected = _reference(query[s:e].float(), seq_keys[i].float(), seq_values[i].float(), context,
                              context + new, window, head)
        assert out.dtype == dtype
        tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(out[s:e].float(), expected, **tolerance)


@pytest.mark.parametrize("seq_lens", [[1], [30], [9, 1, 17, 4]])
def test_a_decode_steps_data_is_the_general_paths(seq_lens, monkeypatch):
    """``prepare`` takes a shortcut for one token per request; it must give what the general
    path gives (a step graph captured from one replays the other's)."""
    seq = np.array(seq_lens, dtype=np.int64)
    start = np.arange(len(seq) + 1, dtype=np.int64)
    metadata = AttentionMetadata(
        num_reqs=len(seq), num_actual_tokens=len(seq), max_query_len=1, max_seq_len=int(seq.max()),
        block_size=BLOCK, query_start_loc=torch.from_numpy(start), seq_lens=torch.from_numpy(seq),
        context_lens=torch.from_numpy(seq - 1), block_table=torch.zeros(len(seq), 8, dtype=torch.int64),
        slot_mapping=torch.from_numpy(seq - 1), query_start_loc_cpu=start, seq_lens_cpu=seq)
    decode, general = _decode_step_data(metadata), _step_data(metadata)
    assert decode.kernel_tokens is None and general.kernel_tokens is None and decode.chunks == general.chunks == []
    for name in ("token_request", "token_position"):
        a, b = getattr(decode, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert decode.token_position.tolist() == [n - 1 for n in seq_lens]
    if kernels_available():  # and prepare takes the shortcut for such a step
        monkeypatch.setattr(attention, "_step_data", None)
        assert torch.equal(CpuPagedAttentionBackend().prepare(metadata).token_position, decode.token_position)


@needs_kernel
# (query heads, KV heads, head size): the AVX-512 value sums take up to 6 heads of 64 (3 of 128)
# a pass over the rows, so these split a task's heads into passes that begin and end inside a KV
# head's group, cross from one KV head to the next, and leave a short last pass
@pytest.mark.parametrize(("heads", "kv_heads", "head"), [(12, 4, 64), (8, 2, 64), (16, 1, 64), (14, 7, 64),
                                                         (10, 5, 128), (8, 2, 128), (4, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_with_query_heads_over_several_value_passes(heads, kv_heads, head, dtype):
    from tokenmill_platform_cpu.kernels import load_kernels

    torch.manual_seed(0)
    block, seq_lens = 16, [37, 5, 64, 1, 23]
    num_blocks = sum(-(-n // block) for n in seq_lens) + 3
    key_cache = torch.randn(num_blocks, block, kv_heads, head).to(dtype)
    value_cache = torch.randn(num_blocks, block, kv_heads, head).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in seq_lens]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(len(seq_lens), heads, head).to(dtype)
    out = load_kernels().paged_attention(query, key_cache, value_cache, table, torch.arange(len(seq_lens)),
                                         torch.tensor(seq_lens) - 1, head**-0.5, 0)
    for i, n in enumerate(seq_lens):
        rows = torch.tensor([tables[i][p // block] * block + p % block for p in range(n)])
        keys = key_cache.flatten(0, 1)[rows].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        values = value_cache.flatten(0, 1)[rows].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        q = query[i].float()[:, None, :]
        expected = ((q @ keys.transpose(1, 2) * head**-0.5).softmax(-1) @ values)[:, 0]
        tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(out[i].float(), expected, **tolerance)
