"""Attention backend interface and per-step metadata."""

from tokenmill.attention.backend import (
    AttentionBackend,
    AttentionRequirements,
    KVCache,
    build_attention_backend,
    create_attention_backend,
    select_attention_backend,
)
from tokenmill.attention.metadata import AttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionRequirements",
    "KVCache",
    "build_attention_backend",
    "create_attention_backend",
    "select_attention_backend",
]
