"""The ``Attention`` layer every model uses; the backend does the work."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, KVCache
from tokenmill.attention.item_blocks import attend_blocks
from tokenmill.attention.kv_spec import KVCacheSpec
from tokenmill.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Multi-head (grouped-query) attention over the paged KV cache.

    Models hand it projected ``q``, ``k``, ``v`` of shape ``[T, heads * head_size]``
    after rotary embedding; the model runner binds the backend and this layer's
    KV cache once, after the cache is allocated. ``logits_soft_cap`` (Gemma 2) caps
    the scaled scores at ``cap * tanh(score / cap)`` before the softmax; only
    backends that declare ``supports_logits_soft_cap`` are chosen for such a model.
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, layer_index: int = 0, *,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads are not a multiple of {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.layer_index = layer_index
        self.logits_soft_cap = logits_soft_cap
        # Per-tensor scales of an fp8 KV cache (stored = k / k_scale): the checkpoint's where it
        # has them (tokenmill.model_loader.kv_scales), else 1.0; unused by a cache in the model's dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.backend: AttentionBackend | None = None
        self.kv_cache: KVCache | None = None
        # A KV connector's worker side (``KVConnectorWorker``) and this layer's index in the
        # model's attention layers, where the engine has one: it may load and save per layer.
        self.kv_connector: Any = None
        self.kv_connector_index = 0

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """What this layer caches a token (tokenmill.attention.kv_spec): a key and a value per KV head."""
        return KVCacheSpec("kv", self.num_kv_heads, self.head_size)

    def bind(self, backend: AttentionBackend, kv_cache: KVCache) -> None:
        self.backend = backend
        self.kv_cache = kv_cache

    def bind_kv_connector(self, connector: Any, index: int) -> None:
        self.kv_connector = connector
        self.kv_connector_index = index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError("Attention layer used before the model runner bound its KV cache")
        tokens = q.shape[0]
        if self.kv_connector is not None:
            self.kv_connector.wait_for_layer_load(self.kv_connector_index)
        out = self.backend.forward(
            self,
            q.view(tokens, self.num_heads, self.head_size),
            k.view(tokens, self.num_kv_heads, self.head_size),
            v.view(tokens, self.num_kv_heads, self.head_size),
            self.kv_cache,
            metadata,
        )
        if metadata.bidirectional_blocks and not getattr(self.backend, "supports_bidirectional_blocks", False):
            out = attend_blocks(self, q.view(tokens, self.num_heads, self.head_size), out, self.kv_cache, metadata)
        if self.kv_connector is not None:
            self.kv_connector.save_kv_layer(self.kv_connector_index, self.kv_cache, metadata)
        return out.reshape(tokens, self.num_heads * self.head_size)
