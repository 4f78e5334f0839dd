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
