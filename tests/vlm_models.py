"""A tiny random LLaVA (CLIP vision tower, projector, the tiny Llama) built with transformers,
with its processor (a CLIP image processor and the shared tiny tokenizer plus ``<image>``)
saved beside it, as a real LLaVA folder looks; and the transformers greedy reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_models import COMMON, build_tokenizer

IMAGE_SIZE, PATCH_SIZE = 32, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # per image, the class token dropped


def build_llava(folder: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    tokenizer = build_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                                           projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(**COMMON),
                                      image_token_id=image_token_id, vision_feature_layer=-2,
                                      vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so argmax is robust
        model.lm_head.weight.normal_(0, 0.5)
        model.model.multi_modal_projector.linear_2.weight.normal_(0, 0.5)  # images that visibly steer the output
    model.save_pretrained(folder, safe_serialization=True)
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                      crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                            patch_size=PATCH_SIZE, num_additional_image_tokens=1,
                                            vision_feature_select_strategy="default",
                                            chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    return folder


def random_image(seed: int, height: int = 40, width: int = 50) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_llava_greedy(folder: Path, prompts: list[tuple[str, list[Any]]], max_new_tokens: int,
                    **processor_kwargs: Any) -> list[list[int]]:
    """Greedy tokens of transformers' LLaVA for each ``(text, images)``, one prompt at a time
    (the processor called with ``processor_kwargs``)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for text, images in prompts:
            inputs = processor(text=text, images=images or None, return_tensors="pt", **processor_kwargs)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=COMMON["pad_token_id"])
            results.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return results
