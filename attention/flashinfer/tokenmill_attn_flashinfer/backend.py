"""Paged attention with FlashInfer: its batch prefill wrapper for steps with a prompt in them,
its batch decode wrapper for steps of decodes only.

A FlashInfer wrapper is planned (its work split over the GPU, from the page table) and then
run; the plan depends on the batch and on the attention's parameters (heads, head size,
scale, window, soft cap). ``prepare`` builds the page table once per step
(:mod:`tokenmill_attn_flashinfer.page_table`); the first layer of each distinct set of
parameters plans its wrapper for the step, and every layer after it only runs, so a model
whose layers all look alike plans once per step. The new tokens' K and V go into the cache
(NHD layout, FlashInfer's and tokenmill's alike) through the slot mapping first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.layers import Attention
from tokenmill.plugin_api import AttentionMetadata, KVCache
from tokenmill_attn_flashinfer.page_table import PageTable, build_page_table

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's float workspace, shared by every wrapper

# (num_heads, num_kv_heads, head_size, scale, window_left, soft cap, decode-only)
PlanKey = tuple[int, int, int, float, int, float | None, bool]


@dataclass
class FlashInferStepData:
    pages: PageTable
    decode_only: bool
    planned: set[PlanKey] = field(default_factory=set)


def _write_kv(kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    key_cache, value_cache = kv_cache
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, block_size: int = 16, **_: Any) -> None:
        import flashinfer  # not installed: the engine takes the next backend

        if not torch.cuda.is_available():
            raise RuntimeError("FlashInfer's kernels need a CUDA device")
        self._flashinfer = flashinfer
        self.block_size = block_size
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[PlanKey, Any] = {}

    def prepare(self, metadata: AttentionMetadata) -> FlashInferStepData:
        pages = build_page_table(metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_table,
                                 metadata.block_size)
        return FlashInferStepData(pages, decode_only=metadata.max_query_len == 1)

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        _write_kv(kv_cache, key, value, metadata.slot_mapping)
        step: FlashInferStepData = metadata.backend_data
        window_left = -1 if layer.sliding_window is None else layer.sliding_window - 1
        plan_key: PlanKey = (layer.num_heads, layer.num_kv_heads, layer.head_size, layer.scale, window_left,
                             layer.logits_soft_cap, step.decode_only)
        wrapper = self._wrapper(plan_key, query.device)
        if plan_key not in step.planned:
            self._plan(wrapper, plan_key, step, query.dtype, kv_cache[0].dtype)
            step.planned.add(plan_key)
        out: torch.Tensor = wrapper.run(query, kv_cache)
        return out

    def _wrapper(self, plan_key: PlanKey, device: torch.device) -> Any:
        if plan_key not in self._wrappers:
            if self._workspace is None:
                self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            if plan_key[-1]:
                self._wrappers[plan_key] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=plan_key[0] != plan_key[1])
            else:
                self._wrappers[plan_key] = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        return self._wrappers[plan_key]

    def _plan(self, wrapper: Any, plan_key: PlanKey, step: FlashInferStepData, q_dtype: torch.dtype,
              kv_dtype: torch.dtype) -> None:
        num_heads, num_kv_heads, head_size, scale, window_left, soft_cap, decode_only = plan_key
        pages = step.pages
        common = dict(num_qo_heads=num_heads, num_kv_heads=num_kv_heads, page_size=self.block_size,
                      window_left=window_left, logits_soft_cap=soft_cap, sm_scale=scale,
                      q_data_type=q_dtype, kv_data_type=kv_dtype)
        if decode_only:
            wrapper.plan(pages.kv_indptr_host, pages.kv_indices, pages.last_page_len_host, head_dim=head_size,
                         **common)
        else:
            wrapper.plan(pages.qo_indptr_host, pages.kv_indptr_host, pages.kv_indices, pages.last_page_len_host,
                         head_dim_qk=head_size, causal=True, **common)
