"""The FlashAttention backend: its argument translation here, and the backend against the
SDPA reference on a CUDA GPU with flash-attn installed (``-m gpu``, run by scripts/gpu-check)."""

from __future__ import annotations

import pytest
import torch
from paged_attention_cases import DECODES, MIXED, paged_case, run_backend, sdpa_reference
from tokenmill_attn_flash.backend import cumulative_lengths, window_size

from tokenmill.layers import Attention


def test_cumulative_lengths_start_at_zero_in_int32():
    out = cumulative_lengths(torch.tensor([3, 1, 5]))
    assert out.tolist() == [0, 3, 4, 9] and out.dtype == torch.int32


def test_window_size_keeps_the_same_keys_as_the_reference_mask():
    """tokenmill keeps key k for query p when p - k < window; FlashAttention keeps p - left <= k <= p."""
    left, right = window_size(5)
    p = 20
    assert [k for k in range(p + 1) if p - k < 5] == list(range(p - left, p + right + 1))
    assert window_size(None) == (-1, -1)


def test_a_block_size_its_paged_path_cannot_read_is_refused():
    pytest.importorskip("flash_attn")
    from tokenmill_attn_flash.backend import FlashAttentionBackend

    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttentionBackend(block_size=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("requests", [MIXED, DECODES])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_matches_sdpa_on_the_gpu(requests, head, dtype, window, cap):
    pytest.importorskip("flash_attn")
    from tokenmill_attn_flash.backend import FlashAttentionBackend

    case = paged_case(requests, 256, 8, 2, head, dtype, "cuda")
    layer = Attention(8, head, 2, head**-0.5, sliding_window=window, logits_soft_cap=cap)
    got = run_backend(FlashAttentionBackend(block_size=256), layer, case)
    torch.testing.assert_close(got.float(), sdpa_reference(layer, case).float(), atol=2e-2, rtol=2e-2)


def documented_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                      softmax_scale, causal, window_size, softcap, block_table):
    """flash_attn_varlen_func's documented semantics with a paged KV (its README and docstring): request
    i's queries ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` attend to its first ``cu_seqlens_k[i+1] - cu_seqlens_k[i]``
    keys read through ``block_table[i]``; causal aligned to the bottom right; query at row p (key position
    p + seqlen_k - seqlen_q) sees keys within ``[p - left, p + right]``; ``softcap`` > 0 caps the scores
    as ``softcap * tanh(s / softcap)``. Written from the documentation, to check the backend's arguments
    where flash-attn itself cannot be installed."""
    block = k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        seqlen_k = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        pages = block_table[i, : -(-seqlen_k // block)]
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:seqlen_k].float()
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:seqlen_k].float()
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k) * softmax_scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(qe - qs)[:, None] + seqlen_k - (qe - qs)
        key_pos = torch.arange(seqlen_k)[None, :]
        allowed = torch.ones_like(scores[0], dtype=torch.bool)
        if causal:
            allowed &= key_pos <= query_pos
        left, right = window_size
        if left >= 0:
            allowed &= key_pos >= query_pos - left
        if right >= 0:
            allowed &= key_pos <= query_pos + right
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)
    return out


@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("requests", [MIXED, DECODES])
def test_the_backends_arguments_give_the_reference_under_the_documented_semantics(requests, window, cap):
    from tokenmill_attn_flash.backend import FlashAttentionBackend

    backend = FlashAttentionBackend.__new__(FlashAttentionBackend)  # flash_attn itself cannot be imported here
    backend._varlen = documented_varlen
    case = paged_case(requests, 16, 8, 2, 32, torch.float32, "cpu")
    layer = Attention(8, 32, 2, 32**-0.5, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(run_backend(backend, layer, case), sdpa_reference(layer, case), atol=1e-5, rtol=1e-5)
