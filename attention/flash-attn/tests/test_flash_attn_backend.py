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
