"""Vision-language model plugin: LLaVA (a CLIP vision tower and a projector in front of a
language model that another model plugin provides) and Qwen2-VL / Qwen2.5-VL (their vision
transformers, M-RoPE positions, images at their own resolution and videos) and Gemma 3 (a SigLIP
tower and its pooling projector in front of the Gemma plugin's decoder; images attended both ways).

This module is the entry point: it imports no torch; the classes load lazily. Each
architecture declares the ``"multimodal"`` capability, which gives its engines the model
folder's own processor for prompts with images (docs/architecture.md, "Multimodal inputs").
"""

from tokenmill.plugin_api import ModelSpec, hookimpl

TOKENMILL_PLUGIN_API = 1

ARCHITECTURES = {
    "LlavaForConditionalGeneration": "tokenmill_models_vlm.llava:LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "tokenmill_models_vlm.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "tokenmill_models_vlm.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "tokenmill_models_vlm.gemma3:Gemma3ForConditionalGeneration",
}
# Models whose folder's AutoProcessor does not serve (Qwen2-VL's needs torchvision): their own.
PROCESSORS = {
    "Qwen2VLForConditionalGeneration": "tokenmill_models_vlm.qwen2_vl_processor:Qwen2VLInputProcessor",
    "Qwen2_5_VLForConditionalGeneration": "tokenmill_models_vlm.qwen2_vl_processor:Qwen2VLInputProcessor",
}
# The capabilities of each: images (all); images whose tokens attend to each other both ways,
# each computed whole in one step (Gemma 3).
CAPABILITIES = {arch: frozenset({"multimodal"}) for arch in ARCHITECTURES}
CAPABILITIES["Gemma3ForConditionalGeneration"] = frozenset({"multimodal", "whole_mm_items"})


@hookimpl
def tokenmill_register_models() -> dict[str, ModelSpec]:
    return {arch: ModelSpec(qualname, supports_pooling=False, capabilities=CAPABILITIES[arch],
                            mm_processor=PROCESSORS.get(arch))
            for arch, qualname in ARCHITECTURES.items()}
