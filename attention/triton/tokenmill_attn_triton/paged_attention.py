"""The paged-attention kernel: one launch for a mixed batch of prefills and decodes.

The grid is ``(query tiles, KV heads)``. A query tile is up to ``tile_q`` consecutive
new tokens of one request (:func:`query_tiles` lists them once per step); its
program takes those tokens times the query heads that share one KV head (grouped-query
attention: each key and value tile is read once for the whole group) as the rows of one
``[rows, head]`` block, and walks the request's keys in tiles of ``KEYS_PER_TILE``
positions, each key found through the block table (a tile may span several cache
blocks, so any block size works). Scores are scaled, soft-capped when asked, masked
(causal, inside the sequence, inside the sliding window) and folded into an online
softmax in float32. The walk starts at the first key the tile's earliest query may see
through its window and stops after the tile's last query's own position, so a decode
token reads only its window and a prefill tile never reads keys past its last query.

With ``num_splits`` > 1 (a third grid axis) each tile's key range is cut into that many
equal shares of key tiles (flash-decoding: a few long decodes still fill the GPU); each
program stores its unnormalised sums with their running maximum and total in float32,
and :func:`_combine_splits` merges them.

Not yet: a tuned tile table per GPU (tile sizes, warps, stages), FP8 KV.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

KEYS_PER_TILE = 32
DECODE_ROWS = 16  # rows of a tile when every query is one token (tl.dot needs 16)
PREFILL_ROWS = 64
WIDE_HEAD_PREFILL_ROWS = 32  # head sizes above 128: a 64-row float32 accumulator would spill registers
NO_WINDOW = 1 << 30
# The split count is a run-time argument (it follows the step's longest sequence, and a
# compile-time one would compile a kernel per count); the combine pads to this many.
MAX_SPLITS = 32  # a power of two


@triton.jit
def _paged_attention(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr,
    tile_request_ptr, tile_offset_ptr, partial_ptr, partial_max_ptr, partial_total_ptr,
    scale, soft_cap, window, head_size, num_tokens, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, num_splits,
    group: tl.constexpr, group_pad: tl.constexpr, tile_q: tl.constexpr, head_pad: tl.constexpr,
    block_size: tl.constexpr, keys_per_tile: tl.constexpr, use_soft_cap: tl.constexpr, precision: tl.constexpr,
    split_keys: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = tl.load(tile_request_ptr + tile)
    first_query = tl.load(tile_offset_ptr + tile)  # the tile's first token, counted within its request
    query_begin = tl.load(query_start_ptr + request)
    query_len = tl.load(query_start_ptr + request + 1) - query_begin
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - query_len

    rows = tl.arange(0, tile_q * group_pad)
    token = first_query + rows // group_pad
    member = rows % group_pad
    head = kv_head * group + member
    row_valid = (token < query_len) & (member < group)
    position = context_len + token
    dims = tl.arange(0, head_pad)
    dim_valid = dims < head_size

    q = tl.load(q_ptr + (query_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    key_end = tl.minimum(context_len + first_query + tile_q, seq_len)  # after the tile's last query
    key_begin = tl.maximum(context_len + first_query - window + 1, 0)  # the earliest any row's window holds
    key_begin = key_begin // keys_per_tile * keys_per_tile
    if split_keys:  # this program's share of the key tiles (flash-decoding); a share may be empty
        tiles_per_split = tl.cdiv(tl.cdiv(key_end - key_begin, keys_per_tile), num_splits)
        key_begin = key_begin + split * tiles_per_split * keys_per_tile
        key_end = tl.minimum(key_end, key_begin + tiles_per_split * keys_per_tile)

    max_score = tl.full([tile_q * group_pad], -1.0e30, dtype=tl.float32)  # finite: a row with no key stays 0
    total = tl.zeros([tile_q * group_pad], dtype=tl.float32)
    acc = tl.zeros([tile_q * group_pad, head_pad], dtype=tl.float32)
    offsets = tl.arange(0, keys_per_tile)
    for start in range(key_begin, key_end, keys_per_tile):
        key_pos = start + offsets
        key_valid = key_pos < key_end
        physical = tl.load(block_table_ptr + request * stride_bt + key_pos // block_size, mask=key_valid, other=0)
        slot = key_pos % block_size
        load_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + physical[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :], mask=load_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=precision) * scale
        if use_soft_cap:
            scores = soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)  # cap * tanh(score / cap)
        visible = ((key_pos[None, :] <= position[:, None]) & key_valid[None, :]
                   & (position[:, None] - key_pos[None, :] < window))
        scores = tl.where(visible, scores * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below
        new_max = tl.maximum(max_score, tl.max(scores, 1))
        rescale = tl.exp2(max_score - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        total = total * rescale + tl.sum(weights, 1)
        v = tl.load(v_cache_ptr + physical[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=load_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=precision)
        max_score = new_max
    if split_keys:  # unnormalised, with its running maximum and total: _combine_splits merges them
        row = (split * num_tokens + query_begin + token) * num_heads + head
        tl.store(partial_ptr + row[:, None] * head_pad + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(partial_max_ptr + row, max_score, mask=row_valid)
        tl.store(partial_total_ptr + row, total, mask=row_valid)
    else:
        acc = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + (query_begin + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _combine_splits(out_ptr, partial_ptr, partial_max_ptr, partial_total_ptr, num_tokens, num_heads, head_size,
                    stride_ot, stride_oh, num_splits, splits_pad: tl.constexpr, head_pad: tl.constexpr):
    """One (token, head): the splits' partial sums rescaled to their common maximum."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, splits_pad)
    used = splits < num_splits
    rows = (splits * num_tokens + token) * num_heads + head
    maxima = tl.load(partial_max_ptr + rows, mask=used, other=-1.0e30)
    totals = tl.load(partial_total_ptr + rows, mask=used, other=0.0)
    dims = tl.arange(0, head_pad)
    partials = tl.load(partial_ptr + rows[:, None] * head_pad + dims[None, :], mask=used[:, None], other=0.0)
    weights = tl.exp2(maxima - tl.max(maxima, 0))  # an empty split: maximum -1e30, total 0, weight 0
    acc = tl.sum(partials * weights[:, None], 0) / tl.sum(totals * weights, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, acc.to(out_ptr.dtype.element_ty),
             mask=dims < head_size)


def tile_shape(group: int, max_query_len: int, head_size: int) -> tuple[int, int]:
    """``(tile_q, group_pad)``: tokens per query tile and the padded query heads per KV head.
    Rows are ``tile_q * group_pad``, at least 16 (``tl.dot``'s smallest tile)."""
    group_pad = triton.next_power_of_2(group)
    if max_query_len == 1:
        rows = DECODE_ROWS
    else:
        rows = PREFILL_ROWS if head_size <= 128 else WIDE_HEAD_PREFILL_ROWS
    return max(rows // group_pad, 1), group_pad


def query_tiles(query_start: np.ndarray, tile_q: int) -> tuple[np.ndarray, np.ndarray]:
    """``(request, first token)`` of every query tile: each request's new tokens cut into
    runs of ``tile_q``; a request with no new tokens has no tile."""
    lens = np.diff(query_start)
    counts = -(-lens // tile_q)
    request = np.repeat(np.arange(len(lens)), counts)
    first_tile = np.cumsum(counts) - counts
    offset = (np.arange(int(counts.sum())) - first_tile[request]) * tile_q
    return request.astype(np.int64), offset.astype(np.int64)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                    tile_request: torch.Tensor, tile_offset: torch.Tensor, tile_q: int, group_pad: int,
                    scale: float, sliding_window: int | None, soft_cap: float | None,
                    num_splits: int = 1) -> torch.Tensor:
    """Attend ``query`` [T, H, D] to the paged cache ([blocks, block_size, H_kv, D]) into ``out``.

    The tiles come from :func:`query_tiles` with the same ``tile_q``; ``group_pad`` from
    :func:`tile_shape`. With ``num_splits`` > 1 each tile's keys are shared among that many
    programs, whose partial results a second launch combines. Every tensor's last
    dimension must be contiguous."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    grid = (tile_request.numel(), num_kv_heads, num_splits)
    if grid[0] == 0:
        return out
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be 1 to {MAX_SPLITS}, not {num_splits}")
    head_pad = max(triton.next_power_of_2(head_size), 16)
    if num_splits > 1:
        partial = torch.empty(num_splits, num_tokens, num_heads, head_pad, dtype=torch.float32, device=query.device)
        partial_max = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device)
        partial_total = torch.empty_like(partial_max)
    else:
        partial = partial_max = partial_total = out  # not read
    _paged_attention[grid](
        out, query, key_cache, value_cache, block_table, query_start, seq_lens, tile_request, tile_offset,
        partial, partial_max, partial_total,
        scale, soft_cap or 1.0, sliding_window or NO_WINDOW, head_size, num_tokens, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0), num_splits,
        group=num_heads // num_kv_heads, group_pad=group_pad, tile_q=tile_q, head_pad=head_pad,
        block_size=block_size, keys_per_tile=KEYS_PER_TILE, use_soft_cap=soft_cap is not None,
        # float32: IEEE products (TF32 would change greedy tokens); else the target's default, as
        # "tf32" is not a precision every AMD target accepts
        precision="ieee" if query.dtype == torch.float32 else None, split_keys=num_splits > 1,
    )
    if num_splits > 1:
        _combine_splits[(num_tokens, num_heads)](
            out, partial, partial_max, partial_total, num_tokens, num_heads, head_size, out.stride(0), out.stride(1),
            num_splits, splits_pad=MAX_SPLITS, head_pad=head_pad,
        )
    return out
