"""Vision-language model plugin: LLaVA (a CLIP vision tower and a projector in front of a
language model that another model plugin provides).

This module is the entry point: it imports no torch; the classes load lazily. Each
architecture declares the ``"multimodal"`` capability, which gives its engines the model
folder's own processor for prompts with images (docs/architecture.md, "Multimodal inputs").
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

ARCHITECTURES = {
    "LlavaForConditionalGeneration": "tokenmill_models_vlm.llava:LlavaForConditionalGeneration",
}


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {arch: ModelSpec(qualname, supports_pooling=False, capabilities=frozenset({"multimodal"}))
            for arch, qualname in ARCHITECTURES.items()}
