"""The interface an attention backend plugin implements, and how one is chosen."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.selection import Chooser, choose_and_build, describe_device, log_selection, rank_backends
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
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype
    block_size: int | None = None  # the KV cache's; None: not known yet (not checked)


def _registered(plugins: PluginManager, platform: Any) -> dict[str, AttentionBackendSpec]:
    return {name: spec for name, (_, spec) in
            plugins.collect_named("tokenmill_register_attention_backends", platform=platform).items()}


def _hook_chooser(plugins: PluginManager, platform: Any, needs: AttentionRequirements) -> Chooser:
    """``tokenmill_select_attention_backend`` over the runnable candidates, best ranked first."""
    def choose(candidates: list[AttentionBackendSpec]) -> str | None:
        return plugins.hook.tokenmill_select_attention_backend(request=needs, candidates=candidates,
                                                               platform=platform)
    return choose


def select_attention_backend(plugins: PluginManager, platform: Any, needs: AttentionRequirements,
                             exclude: frozenset[str] = frozenset()) -> AttentionBackendSpec:
    """The spec the engine would build first (without building it): the hooks' choice among the
    registered backends that can run here, best ranked first."""
    registered = _registered(plugins, platform)
    ranked = [r for r in rank_backends(registered.values(), needs, describe_device(platform))
              if r.spec.name not in exclude]
    selection = choose_and_build(ranked, needs, describe_device(platform), _hook_chooser(plugins, platform, needs),
                                 build=lambda spec: cast(AttentionBackend, None))
    return selection.spec


def build_attention_backend(spec: AttentionBackendSpec, **kwargs: Any) -> AttentionBackend:
    backend_cls = resolve_qualname(spec.qualname)
    return backend_cls(**kwargs)


def create_attention_backend(plugins: PluginManager, platform: Any, needs: AttentionRequirements,
                             **kwargs: Any) -> AttentionBackend:
    """Select and build a backend; one that fails to import or build (a kernel without its
    compiler, a library not installed) is skipped for the next one down the list, unless the
    user asked for it by name. Logs the choice and why each backend above it was passed over."""
    device = describe_device(platform)
    ranked = rank_backends(_registered(plugins, platform).values(), needs, device)
    selection = choose_and_build(ranked, needs, device, _hook_chooser(plugins, platform, needs),
                                 build=lambda spec: build_attention_backend(spec, **kwargs))
    log_selection(selection, needs)
    return selection.backend
