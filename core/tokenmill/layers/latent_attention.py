"""``LatentAttention``: attention over a latent KV cache, one shared entry a token (DeepSeek's MLA)."""

from __future__ import annotations

import torch

from tokenmill.attention.kv_spec import KVCacheSpec
from tokenmill.attention.latent import latent_attention, write_latent
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.layers.attention import Attention


class LatentAttention(Attention):
    """``num_heads`` query heads over one cached entry of ``entry_size`` features a token, whose
    first ``latent_size`` features are every head's value (``tokenmill.attention.latent``).

    Its cache is of kind ``"latent"`` (``tokenmill.attention.kv_spec``): one
    ``[blocks, block_size, 1, entry_size]`` tensor, bound like any layer's by the model runner,
    written and read here (the torch/SDPA reference) rather than by the attention backend, which
    serves the model's other layers. An fp8 cache uses ``k_scale`` for the entries. Under tensor
    parallelism the entry is the same on every rank (it is shared by all heads), so each rank
    caches all of it for its own share of the query heads.
    """

    def __init__(self, num_heads: int, entry_size: int, latent_size: int, scale: float, layer_index: int = 0) -> None:
        super().__init__(num_heads, entry_size, 1, scale, None, layer_index)
        if not 0 < latent_size <= entry_size:
            raise ValueError(f"latent size {latent_size} must lie in 1..{entry_size} (the entry size)")
        self.latent_size = latent_size

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec("latent", 1, self.head_size)

    def forward(self, query: torch.Tensor, entry: torch.Tensor,  # type: ignore[override]  # one entry, not K and V
                metadata: AttentionMetadata) -> torch.Tensor:
        """``query`` [T, heads * entry_size] and the new tokens' ``entry`` [T, entry_size]
        -> [T, heads * latent_size]."""
        if self.kv_cache is None:
            raise RuntimeError("LatentAttention used before the model runner bound its KV cache")
        tokens = query.shape[0]
        if self.kv_connector is not None:
            self.kv_connector.wait_for_layer_load(self.kv_connector_index)
        cache = self.kv_cache[0]
        write_latent(cache, metadata.slot_mapping, entry, self.k_scale)
        out = latent_attention(query.view(tokens, self.num_heads, self.head_size), cache, metadata, self.scale,
                               self.latent_size, self.k_scale)
        if self.kv_connector is not None:
            self.kv_connector.save_kv_layer(self.kv_connector_index, self.kv_cache, metadata)
        return out.reshape(tokens, self.num_heads * self.latent_size)
