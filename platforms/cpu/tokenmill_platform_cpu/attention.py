"""The CPU platform's attention backend.

Decode tokens, other short queries and every query of a short sequence go
through the C++ paged kernel, which reads each request's keys and values in
place through its block table instead of gathering them into a padded copy
first — the gather was half of a decode step's time with the SDPA reference
backend. Long query chunks of long sequences go through torch SDPA per
request, whose blocked kernel beats a per-token walk once queries attend to
many keys: a whole prompt attends to the keys just computed with a plain
causal mask; a chunk that continues a cached prefix gathers its blocks and
uses an explicit mask. Below that length SDPA's per-request calls cost more
than the walk (see KERNEL_MAX_SEQ_LEN).

An fp8 KV cache (``kv_cache_dtype``) takes a torch path for now: the new tokens
are quantised on write (``tokenmill.kv_cache.fp8``), and each step dequantises
only the blocks its requests' block tables name into a temporary cache in the
model's dtype, which the same kernel and SDPA paths then read. That keeps the
memory saving (the whole cache stays in float8) at the cost of a per-layer
gather, as the SDPA reference pays; the C++ kernel reading float8 in place is
future work. Such a backend captures no step graphs (the graph records kernel
calls, not the torch ops of the dequantising gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.layers import Attention
from tokenmill.plugin_api import (
    AttentionMetadata,
    KVCache,
    dequantize_kv,
    gather_blocks,
    is_fp8,
    kv_cache_torch_dtype,
    quantize_kv,
    write_kv,
)
from tokenmill_platform_cpu.kernels import load_kernels
from tokenmill_platform_cpu.step_graph import active_kernels

# Queries of at most this many tokens use the paged kernel,
KERNEL_MAX_QUERY_LEN = 8
# and so do all the queries of a sequence of at most this many tokens. A whole prompt's causal
# attention, one layer of 12 heads on 4 (head size 64, bfloat16, two threads): 64 prompts of 128
# tokens took 31.6 ms through SDPA per request and 19.0 through the kernel, 32 of 256 48.1 / 34.5,
# 16 of 512 89.0 / 67.5, 8 of 768 76.7 / 75.6, 4 of 1,024 62.5 / 70.6 (float32 alike).
KERNEL_MAX_SEQ_LEN = 512


@dataclass
class _Chunk:
    """A long query chunk of one request, attended with SDPA."""

    start: int  # first token in the flattened batch
    end: int
    request: int
    context_len: int  # tokens before the chunk
    seq_len: int


@dataclass
class PagedStepData:
    kernel_tokens: torch.Tensor | None  # flat indices of kernel tokens; None: every token
    token_request: torch.Tensor  # [kernel tokens] their request's row in the block table
    token_position: torch.Tensor  # [kernel tokens] their position in the sequence
    chunks: list[_Chunk] = field(default_factory=list)
    masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)


class CpuPagedAttentionBackend:
    name = "cpu-paged"
    # A decode step (every query one token) always takes the kernel path below, whose work
    # depends only on the contents of the metadata's tensors and of prepare()'s result.
    supports_step_graphs = True

    def __init__(self, kv_cache_dtype: str = "auto", **_: object) -> None:
        kernels = load_kernels()
        if kernels is None:
            raise RuntimeError("the CPU paged attention kernel could not be built")
        self._kernels = kernels
        if is_fp8(kv_cache_torch_dtype(kv_cache_dtype, torch.float32)):
            self.supports_step_graphs = False

    def prepare(self, metadata: AttentionMetadata) -> PagedStepData:
        if metadata.max_query_len == 1 and metadata.num_actual_tokens == metadata.num_reqs:
            return _decode_step_data(metadata)
        return _step_data(metadata)

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        step: PagedStepData = metadata.backend_data
        kv_cache_fp8 = kv_cache[0].dtype
        if is_fp8(kv_cache[0].dtype):
            kv_cache, metadata = self._dequantised_step(layer, key, value, kv_cache, metadata)
            # A whole prompt attends to its new keys directly: round them as the cache holds them,
            # so its output does not depend on whether a prefix came from the cache.
            key = dequantize_kv(quantize_kv(key, layer.k_scale, kv_cache_fp8), layer.k_scale, key.dtype)
            value = dequantize_kv(quantize_kv(value, layer.v_scale, kv_cache_fp8), layer.v_scale, value.dtype)
        else:
            active_kernels(self._kernels).write_kv_cache(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)
        if step.kernel_tokens is None:
            return self._paged(layer, query.contiguous(), kv_cache, metadata, step)
        out = torch.empty_like(query)
        if len(step.kernel_tokens):
            out[step.kernel_tokens] = self._paged(layer, query[step.kernel_tokens].contiguous(), kv_cache,
                                                  metadata, step)
        for chunk in step.chunks:
            rows = slice(chunk.start, chunk.end)
            if chunk.context_len == 0 and (layer.sliding_window is None or layer.sliding_window >= chunk.seq_len):
                # A whole prompt: its keys are the ones just computed, and the mask is plain causal.
                out[rows] = self._causal(layer, query[rows], key[rows], value[rows])
            else:
                out[rows] = self._sdpa(layer, query[rows], kv_cache, metadata, chunk, step)
        return out

    @staticmethod
    def _dequantised_step(layer: Attention, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                          metadata: AttentionMetadata) -> tuple[KVCache, AttentionMetadata]:
        """Write the new tokens into the float8 cache; return a cache in the model's dtype of
        just the blocks the step's block table names, and the metadata with the block table
        renumbered into it."""
        import dataclasses

        shape = (-1, layer.num_kv_heads, layer.head_size)
        write_kv(kv_cache[0].view(shape), metadata.slot_mapping, key, layer.k_scale)
        write_kv(kv_cache[1].view(shape), metadata.slot_mapping, value, layer.v_scale)
        used, renumbered = torch.unique(metadata.block_table, return_inverse=True)
        dense = (gather_blocks(kv_cache[0], used, layer.k_scale, key.dtype),
                 gather_blocks(kv_cache[1], used, layer.v_scale, value.dtype))
        table = renumbered.to(metadata.block_table.dtype)
        return dense, dataclasses.replace(metadata, block_table=table)

    def _paged(self, layer: Attention, query: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
               step: PagedStepData) -> torch.Tensor:
        return active_kernels(self._kernels).paged_attention(
            query, kv_cache[0], kv_cache[1], metadata.block_table, step.token_request, step.token_position,
            layer.scale, layer.sliding_window or 0)

    @staticmethod
    def _causal(layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            _heads_first(query), _heads_first(key), _heads_first(value), is_causal=True, scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out[0].transpose(0, 1)

    def _sdpa(self, layer: Attention, query: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
              chunk: _Chunk, step: PagedStepData) -> torch.Tensor:
        num_blocks = -(-chunk.seq_len // metadata.block_size)
        blocks = metadata.block_table[chunk.request, :num_blocks]
        shape = (-1, layer.num_kv_heads, layer.head_size)
        k = kv_cache[0].index_select(0, blocks).view(shape)[: chunk.seq_len]
        v = kv_cache[1].index_select(0, blocks).view(shape)[: chunk.seq_len]
        out = F.scaled_dot_product_attention(
            _heads_first(query), _heads_first(k), _heads_first(v), attn_mask=self._mask(chunk, layer.sliding_window, step),
            scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out[0].transpose(0, 1)

    @staticmethod
    def _mask(chunk: _Chunk, window: int | None, step: PagedStepData) -> torch.Tensor:
        """Causal (and windowed) mask of a chunk whose queries start at ``context_len``."""
        key = (chunk.request, window)
        if key not in step.masks:
            query_pos = torch.arange(chunk.context_len, chunk.seq_len)[:, None]
            key_pos = torch.arange(chunk.seq_len)[None, :]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= (query_pos - key_pos) < window
            step.masks[key] = mask
        return step.masks[key]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D]. SDPA on the CPU takes its fused (flash) kernel only for
    4-d inputs: 3-d ones run the unfused math path, 2.3x (128 tokens) to 10x (2,048)
    slower for a causal prompt."""
    return x.transpose(0, 1).unsqueeze(0)


def _step_data(metadata: AttentionMetadata) -> PagedStepData:
    """Any step's: the tokens of short queries and short sequences for the kernel, the other
    queries as SDPA chunks."""
    query_start = metadata.query_start_loc_cpu
    query_lens = np.diff(query_start)
    context_lens = metadata.seq_lens_cpu - query_lens
    in_kernel = (query_lens <= KERNEL_MAX_QUERY_LEN) | (metadata.seq_lens_cpu <= KERNEL_MAX_SEQ_LEN)
    token_request = np.repeat(np.arange(len(query_lens)), query_lens)
    token_position = context_lens[token_request] + np.arange(query_start[-1]) - query_start[:-1][token_request]
    chunks = [_Chunk(int(query_start[i]), int(query_start[i + 1]), int(i), int(context_lens[i]),
                     int(metadata.seq_lens_cpu[i])) for i in np.flatnonzero(~in_kernel)]
    if not chunks:
        return PagedStepData(None, torch.from_numpy(token_request), torch.from_numpy(token_position))
    kernel_tokens = np.flatnonzero(in_kernel[token_request])
    return PagedStepData(torch.from_numpy(kernel_tokens), torch.from_numpy(token_request[kernel_tokens]),
                         torch.from_numpy(token_position[kernel_tokens]), chunks)


def _decode_step_data(metadata: AttentionMetadata) -> PagedStepData:
    """``prepare`` for a step of one token per request (every decode step): token ``i`` is
    request ``i``'s, at its last position, and no query is long, so the per-token repeats
    and gathers of the general path are not needed. At batch 1 they were most of a decode
    step's ``prepare`` (tests/test_paged_attention.py checks the two agree)."""
    positions = np.asarray(metadata.seq_lens_cpu, dtype=np.int64) - 1
    return PagedStepData(None, torch.arange(metadata.num_reqs), torch.from_numpy(positions))
