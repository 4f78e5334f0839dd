"""FlashInfer's page table from tokenmill's metadata (here), and the backend against the SDPA
reference on a CUDA GPU with flashinfer installed (``-m gpu``, run by scripts/gpu-check)."""

from __future__ import annotations

import pytest
import torch
from paged_attention_cases import DECODES, MIXED, paged_case, run_backend, sdpa_reference
from tokenmill_attn_flashinfer.page_table import build_page_table

from tokenmill.layers import Attention


@pytest.mark.parametrize("requests", [MIXED, DECODES])
def test_page_table_lists_each_requests_pages_in_order(requests):
    block = 4
    case = paged_case(requests, block, 4, 2, 8, torch.float32, "cpu")
    metadata = case.metadata
    pages = build_page_table(metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_table, block)
    indptr, indices = pages.kv_indptr_host.tolist(), pages.kv_indices.tolist()
    for i, (context, new) in enumerate(requests):
        used = -(-(context + new) // block)
        assert indices[indptr[i]:indptr[i + 1]] == metadata.block_table[i, :used].tolist()
        assert 1 <= pages.last_page_len_host[i] <= block
        assert (used - 1) * block + int(pages.last_page_len_host[i]) == context + new
    assert pages.qo_indptr_host.tolist() == metadata.query_start_loc_cpu.tolist()
    assert pages.kv_indices.dtype == pages.kv_indptr_host.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("requests", [MIXED, DECODES])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_matches_sdpa_on_the_gpu(requests, head, dtype, window, cap):
    pytest.importorskip("flashinfer")
    from tokenmill_attn_flashinfer.backend import FlashInferBackend

    case = paged_case(requests, 16, 8, 2, head, dtype, "cuda")
    layer = Attention(8, head, 2, head**-0.5, sliding_window=window, logits_soft_cap=cap)
    got = run_backend(FlashInferBackend(block_size=16), layer, case)
    torch.testing.assert_close(got.float(), sdpa_reference(layer, case).float(), atol=2e-2, rtol=2e-2)


class DocumentedPagedWrapper:
    """FlashInfer's paged prefill/decode wrappers as their documentation describes them (plan with the
    CSR page table, then run per layer; NHD pages; causal aligned to the end of each sequence; a query
    at key position p sees keys >= p - window_left; scores capped as cap * tanh(s / cap)), written here to
    check the backend's plan arguments where flashinfer cannot be installed."""

    def __init__(self, workspace, kv_layout, use_tensor_cores=False):
        assert kv_layout == "NHD"
        self.decode = False

    def plan(self, *tables, num_qo_heads, num_kv_heads, page_size, window_left, logits_soft_cap, sm_scale,
             q_data_type, kv_data_type, head_dim=None, head_dim_qk=None, causal=None):
        if len(tables) == 3:  # the decode wrapper: one query per request
            kv_indptr, kv_indices, last_page_len = tables
            qo_indptr = torch.arange(len(kv_indptr), dtype=torch.int32)
            causal = True
        else:
            qo_indptr, kv_indptr, kv_indices, last_page_len = tables
        assert causal and kv_indices.dtype == torch.int32
        self.args = (qo_indptr, kv_indptr, kv_indices, last_page_len, page_size, window_left, logits_soft_cap,
                     sm_scale)

    def run(self, q, kv_cache):
        qo_indptr, kv_indptr, kv_indices, last_page_len, page_size, window_left, cap, scale = self.args
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
        for i in range(len(qo_indptr) - 1):
            qs, qe = int(qo_indptr[i]), int(qo_indptr[i + 1])
            pages = kv_indices[int(kv_indptr[i]):int(kv_indptr[i + 1])].long()
            seqlen_k = (len(pages) - 1) * page_size + int(last_page_len[i])
            k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:seqlen_k]
            v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:seqlen_k]
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe], k) * scale
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            query_pos = torch.arange(qe - qs)[:, None] + seqlen_k - (qe - qs)
            key_pos = torch.arange(seqlen_k)[None, :]
            allowed = key_pos <= query_pos
            if window_left >= 0:
                allowed &= key_pos >= query_pos - window_left
            out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        return out


@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("requests", [MIXED, DECODES])
def test_the_backends_plan_gives_the_reference_under_the_documented_semantics(requests, window, cap):
    from types import SimpleNamespace

    from tokenmill_attn_flashinfer.backend import FlashInferBackend

    backend = FlashInferBackend.__new__(FlashInferBackend)  # flashinfer needs CUDA; its documented wrappers here
    backend._flashinfer = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=DocumentedPagedWrapper,
                                          BatchDecodeWithPagedKVCacheWrapper=DocumentedPagedWrapper)
    backend.block_size, backend._workspace, backend._wrappers = 4, None, {}
    case = paged_case(requests, 4, 8, 2, 16, torch.float32, "cpu")
    layer = Attention(8, 16, 2, 16**-0.5, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(run_backend(backend, layer, case), sdpa_reference(layer, case), atol=1e-5, rtol=1e-5)
