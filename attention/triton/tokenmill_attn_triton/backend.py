"""The Triton attention backend: the KV write kernel, then one paged-attention launch
per layer for the whole mixed batch.

``prepare`` cuts each request's new tokens into query tiles once per step (on the
host, from the CPU copy of ``query_start_loc``) and copies the tile list to the
device once per tile size; the layers of a model share one size unless their
grouped-query ratios differ.

A step of decodes alone has one tile per request: with few requests that is fewer
programs than the GPU has multiprocessors, so each request's keys are then shared
among several programs (:func:`decode_splits`), whose partial results a second launch
combines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch

from tokenmill.layers import Attention
from tokenmill.plugin_api import AttentionMetadata, KVCache
from tokenmill_attn_triton.cache_write import write_kv_cache
from tokenmill_attn_triton.paged_attention import (
    KEYS_PER_TILE,
    MAX_SPLITS,
    paged_attention,
    query_tiles,
    tile_shape,
)

MIN_KEY_TILES_PER_SPLIT = 4  # below this a split's fixed cost (its query load, the combine) dominates


@dataclass
class TritonStepData:
    """The step's metadata plus its query tiles, by tokens per tile."""

    metadata: AttentionMetadata
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tiles_of(self, tile_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        if tile_q not in self.tiles:
            request, offset = query_tiles(self.metadata.query_start_loc_cpu, tile_q)
            device = self.metadata.query_start_loc.device
            self.tiles[tile_q] = (torch.from_numpy(request).to(device, non_blocking=True),
                                  torch.from_numpy(offset).to(device, non_blocking=True))
        return self.tiles[tile_q]


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None, **_: object) -> None:
        """``num_splits``: share each decode's keys among this many programs (None: chosen per step)."""
        import triton  # noqa: F401  (fails here, and the engine picks another backend, where Triton is missing)

        self.num_splits = num_splits

    def prepare(self, metadata: AttentionMetadata) -> TritonStepData:
        return TritonStepData(metadata)

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        write_kv_cache(_last_dim_contiguous(key), _last_dim_contiguous(value), key_cache, value_cache,
                       metadata.slot_mapping)
        step: TritonStepData = metadata.backend_data
        tile_q, group_pad = tile_shape(layer.num_heads // layer.num_kv_heads, metadata.max_query_len,
                                     layer.head_size)
        tile_request, tile_offset = step.tiles_of(tile_q)
        query = _last_dim_contiguous(query)
        out = query.new_empty(query.shape)  # contiguous: the layer views it as [T, H * D]
        splits = 1
        if metadata.max_query_len == 1:
            splits = self.num_splits or decode_splits(metadata.num_reqs * layer.num_kv_heads, metadata.max_seq_len,
                                                      query.device)
        return paged_attention(out, query, key_cache, value_cache, metadata.block_table, metadata.query_start_loc,
                               metadata.seq_lens, tile_request, tile_offset, tile_q, group_pad, layer.scale,
                               layer.sliding_window, layer.logits_soft_cap, splits)


def decode_splits(programs: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per decode that give the GPU about two programs per multiprocessor, each
    with at least ``MIN_KEY_TILES_PER_SPLIT`` key tiles; 1 off a GPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    wanted = -(-2 * _multiprocessors(device) // programs)
    most = max_seq_len // (KEYS_PER_TILE * MIN_KEY_TILES_PER_SPLIT)
    return max(1, min(wanted, most, MAX_SPLITS))


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
