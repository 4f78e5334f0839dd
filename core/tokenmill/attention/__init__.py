"""Attention backend interface and per-step metadata."""

from tokenmill.attention.backend import (
    AttentionBackend,
    AttentionRequirements,
    KVCache,
    build_attention_backend,
    create_attention_backend,
    select_attention_backend,
)
from tokenmill.attention.kv_spec import KVCacheKind, KVCacheSpec
from tokenmill.attention.latent import latent_attention, write_latent
from tokenmill.attention.metadata import AttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionRequirements",
    "KVCache",
    "KVCacheKind",
    "KVCacheSpec",
    "build_attention_backend",
    "create_attention_backend",
    "latent_attention",
    "select_attention_backend",
    "write_latent",
]
