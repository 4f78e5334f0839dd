"""The host-side layout of a step: query tiles, tile shapes and decode splits (no kernel runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from tokenmill_attn_triton.backend import decode_splits
from tokenmill_attn_triton.paged_attention import paged_attention, query_tiles, tile_shape


def test_each_request_is_cut_into_tiles_of_its_own():
    # new tokens per request: 5, 0 (none this step), 16, 17
    request, offset = query_tiles(np.array([0, 5, 5, 21, 38]), tile_q=8)
    assert request.tolist() == [0, 2, 2, 3, 3, 3]
    assert offset.tolist() == [0, 0, 8, 0, 8, 16]


@pytest.mark.parametrize(("group", "max_query_len", "head_size", "expected"), [
    (1, 1, 64, (16, 1)),  # decodes: the 16 rows tl.dot needs
    (4, 1, 64, (4, 4)),
    (3, 7, 64, (16, 4)),  # a group of 3 is padded to 4: 64 rows
    (8, 300, 128, (8, 8)),
    (2, 300, 256, (16, 2)),  # a wide head: 32 rows
    (32, 1, 64, (1, 32)),  # a group wider than the rows
])
def test_tile_shapes(group, max_query_len, head_size, expected):
    assert tile_shape(group, max_query_len, head_size) == expected


def test_decodes_are_split_only_on_a_gpu():
    assert decode_splits(8, 100_000, torch.device("cpu")) == 1


def test_a_split_count_out_of_range_is_refused():
    query = torch.zeros(1, 2, 16)
    cache = torch.zeros(1, 16, 1, 16)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(torch.empty_like(query), query, cache, cache, one.view(1, 1), torch.tensor([0, 1]),
                        torch.tensor([1]), one, one, 16, 2, 0.25, None, None, num_splits=33)
