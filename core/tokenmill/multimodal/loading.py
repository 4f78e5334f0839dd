"""Which engines get a multimodal processor: those whose model plugin says it takes images."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from tokenmill.model_loader.loader import registered_model_spec

if TYPE_CHECKING:
    from tokenmill.model_loader.checkpoint import Checkpoint
    from tokenmill.multimodal.processor import MultiModalProcessor
    from tokenmill.plugins.manager import PluginManager

# The ModelSpec capability of a model class that implements MultiModalCausalLM.
MULTIMODAL = "multimodal"
# The ModelSpec capability of a multimodal model whose items' tokens attend to each other both ways
# (Gemma 3): each item is computed whole in one step (tokenmill.scheduler.whole_items).
WHOLE_MM_ITEMS = "whole_mm_items"


def computes_items_whole(checkpoint: Checkpoint, plugins: PluginManager) -> bool:
    """Whether the architecture's :class:`ModelSpec` lists :data:`WHOLE_MM_ITEMS`."""
    spec = registered_model_spec(checkpoint, plugins)
    return spec is not None and WHOLE_MM_ITEMS in spec.capabilities


def multimodal_processor(checkpoint: Checkpoint, plugins: PluginManager,
                         limits: Mapping[str, int]) -> MultiModalProcessor | None:
    """The model folder's processor when the architecture's :class:`ModelSpec` lists the
    ``"multimodal"`` capability; None for a text model (a prompt with images is refused)."""
    spec = registered_model_spec(checkpoint, plugins)
    if spec is None or MULTIMODAL not in spec.capabilities:
        return None
    if spec.mm_processor is not None:  # the model plugin's own processor
        from tokenmill.plugins.specs import resolve_qualname

        processor: MultiModalProcessor = resolve_qualname(spec.mm_processor)(checkpoint.path, checkpoint.hf_config,
                                                                             limits)
        return processor
    from tokenmill.multimodal.processor import MultiModalProcessor

    return MultiModalProcessor(checkpoint.path, checkpoint.hf_config, limits)
