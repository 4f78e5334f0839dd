"""The interface an attention backend plugin implements, and how one is chosen."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.errors import PluginError
from tokenmill.plugins.specs import AttentionBackendSpec, resolve_qualname

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention
    from tokenmill.plugins.manager import PluginManager

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, num_kv_heads, head_size]


class AttentionBackend(Protocol):
    """Paged attention over a mixed batch of prefills and decodes.

    ``prepare`` runs once per step; ``forward`` once per layer. ``forward``
    first writes the new tokens' K and V into ``kv_cache`` at
    ``metadata.slot_mapping``, then attends each query to its request's cached
    keys (causal, within ``layer.sliding_window`` when set; scores soft-capped as
    ``cap * tanh(score / cap)`` with ``cap = layer.logits_soft_cap`` when set, a
    backend that declares ``supports_logits_soft_cap``).
    """

    name: str

    def prepare(self, metadata: AttentionMetadata) -> Any: ...

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        """``query`` [T, H, D], ``key``/``value`` [T, H_kv, D] -> output [T, H, D]."""
        ...


@dataclass(frozen=True)
class AttentionRequirements:
    """What the model needs from a backend; the user's explicit choice if any."""

    device_type: str
    dtype: str
    head_size: int
    sliding_window: bool
    preferred: str | None = None
    logits_soft_cap: bool = False


def select_attention_backend(plugins: PluginManager, platform: Any, needs: AttentionRequirements,
                             exclude: frozenset[str] = frozenset()) -> AttentionBackendSpec:
    """Collect the registered backends, keep those that fit, let the hooks choose."""
    registered = {name: spec for name, (_, spec) in
                  plugins.collect_named("tokenmill_register_attention_backends", platform=platform).items()}
    if needs.preferred is not None and needs.preferred not in registered:
        raise PluginError(f"attention backend {needs.preferred!r} is not installed; have {sorted(registered)}")
    candidates = [s for s in registered.values() if s.name not in exclude
                  and s.supports(needs.device_type, needs.dtype, needs.head_size, needs.sliding_window,
                                 needs.logits_soft_cap)]
    if needs.preferred is not None and needs.logits_soft_cap and registered[needs.preferred] not in candidates:
        # Run anyway, it would compute other scores than the model's.
        raise PluginError(f"attention backend {needs.preferred!r} cannot soft-cap attention scores, which this "
                          f"model needs ({needs})")
    chosen = plugins.hook.tokenmill_select_attention_backend(request=needs, candidates=candidates, platform=platform)
    if chosen is None:
        raise PluginError(f"no installed attention backend supports {needs}; registered: {sorted(registered)}")
    return registered[chosen]


def build_attention_backend(spec: AttentionBackendSpec, **kwargs: Any) -> AttentionBackend:
    backend_cls = resolve_qualname(spec.qualname)
    return backend_cls(**kwargs)


def create_attention_backend(plugins: PluginManager, platform: Any, needs: AttentionRequirements,
                             **kwargs: Any) -> AttentionBackend:
    """Select and build a backend; one that fails to build (a kernel without its compiler, say)
    is skipped for the next choice, unless the user asked for it by name."""
    failed: set[str] = set()
    while True:
        spec = select_attention_backend(plugins, platform, needs, frozenset(failed))
        try:
            return build_attention_backend(spec, **kwargs)
        except Exception as exc:
            if needs.preferred is not None:
                raise PluginError(f"attention backend {spec.name!r} failed to start: {exc}") from exc
            logger.warning("attention backend %s failed to start (%s); choosing another", spec.name, exc)
            failed.add(spec.name)
