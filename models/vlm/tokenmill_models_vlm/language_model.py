"""The language model of a vision-language checkpoint, built by whichever model plugin
registers its architecture (Llama's for LLaVA-1.5): no decoder is copied here."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from tokenmill.layers import ModelBuildContext
from tokenmill.plugin_api import UnsupportedModelError, get_plugin_manager, resolve_qualname


def text_architecture(text_config: Any) -> str:
    """The causal-LM architecture of ``text_config``: named in it, else the one transformers
    pairs with its ``model_type``."""
    named = getattr(text_config, "architectures", None)
    if named:
        return str(named[0])
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text_config.model_type)
    if architecture is None:
        raise UnsupportedModelError(f"no causal-LM architecture is known for model_type {text_config.model_type!r}")
    return str(architecture)


def build_language_model(text_config: Any, ctx: ModelBuildContext, architecture: str | None = None) -> nn.Module:
    """The registered class of ``text_config``'s architecture (or of ``architecture``, for a
    text config transformers pairs with no causal LM: Qwen2-VL's), built under ``ctx`` (whose
    prefix is where its tensors sit in the checkpoint) with ``text_config`` as its config."""
    architecture = architecture or text_architecture(text_config)
    registered = get_plugin_manager().collect_named("tokenmill_register_models")
    if architecture not in registered:
        raise UnsupportedModelError(f"the language model {architecture} is not registered by any installed model "
                                    "plugin")
    model_cls = resolve_qualname(registered[architecture][1].qualname)
    return model_cls(text_config, ctx=dataclasses.replace(ctx, hf_config=text_config))
