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
