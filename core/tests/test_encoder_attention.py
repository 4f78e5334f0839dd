"""Bidirectional attention both ways (one padded SDPA call, or sequence by sequence) against
SDPA run on each sequence alone: every token attends to all of its own sequence's tokens and
to no other sequence's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention.encoder import EncoderBatch, bidirectional_attention

LENGTHS = [5, 1, 17, 9, 32]


def _metadata(lengths: list[int]) -> SimpleNamespace:
    lens = np.array(lengths, dtype=np.int64)
    return SimpleNamespace(query_start_loc_cpu=np.concatenate([[0], np.cumsum(lens)]), seq_lens_cpu=lens)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    outs, start = [], 0
    for n in lengths:
        seq = [x[start : start + n].float().transpose(0, 1) for x in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*seq, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("per_sequence", [True, False])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_each_token_attends_to_its_own_sequence_only(per_sequence, dtype, tolerance):
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), 4, 16).to(dtype) for _ in range(3))
    batch = EncoderBatch.from_metadata(_metadata(LENGTHS), torch.device("cpu"), per_sequence=per_sequence)
    out = bidirectional_attention(q, k, v, batch, scale=0.3)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(q, k, v, LENGTHS, 0.3), atol=tolerance, rtol=tolerance)


def test_the_cpu_runs_sequence_by_sequence_and_a_chunked_sequence_is_refused():
    assert EncoderBatch.from_metadata(_metadata(LENGTHS), torch.device("cpu")).spans == [
        (0, 5), (5, 6), (6, 23), (23, 32), (32, 64)]
    chunked = _metadata(LENGTHS)
    chunked.seq_lens_cpu = chunked.seq_lens_cpu + 1  # each has a token from an earlier step
    with pytest.raises(RuntimeError, match="non_causal_prefill"):
        EncoderBatch.from_metadata(chunked, torch.device("cpu"))
