"""A tiny random LLaVA (CLIP vision tower, projector, the tiny Llama) built with transformers,
with its processor (a CLIP image processor and the shared tiny tokenizer plus ``<image>``)
saved beside it, as a real LLaVA folder looks; and the transformers greedy reference."""

from __future__ import annotations

import functools
from collections.abc import Callable
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
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    return _hf_greedy_each(folder, functools.partial(processor, **processor_kwargs), prompts, max_new_tokens)


def _hf_greedy_each(folder: Path, processor: Callable[..., Any], prompts: list[tuple[str, list[Any]]],
                    max_new_tokens: int,
                    adjust: Callable[[int, dict[str, Any], Any], dict[str, Any]] | None = None) -> list[list[int]]:
    """Greedy tokens of transformers' image-text model in ``folder`` for each ``(text, images)``,
    one prompt at a time; ``adjust(index, inputs, model_config)``, where given, changes prompt
    ``index``'s processor output before it is generated from."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for index, (text, images) in enumerate(prompts):
            inputs = dict(processor(text=text, images=images or None, return_tensors="pt"))
            if adjust is not None:
                inputs = adjust(index, inputs, model.config)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=COMMON["pad_token_id"])
            results.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return results


# -- Qwen2-VL ------------------------------------------------------------------
QWEN2_VL_PATCH, QWEN2_VL_MERGE = 4, 2  # tiny patches: an image of 32x40 pixels is 8x10 patches, 20 tokens
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN2_VL_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def build_qwen2_vl(folder: Path, seed: int = 0, version: str = "2") -> Path:
    """A tiny random Qwen2-VL (``version`` "2.5": Qwen2.5-VL, with window attention over
    windows of 2x2 merged tokens in its first block) of 2 vision blocks 32 wide and the tiny
    Qwen2 language model with M-RoPE sections [2, 3, 3], and its image processor, saved as a
    real folder is."""
    import torch
    import transformers

    tokenizer = build_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_TOKENS)})
    tokenizer.save_pretrained(folder)
    start, end, image, video = (tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_TOKENS)
    text = {**COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    shared = dict(depth=2, num_heads=4, patch_size=QWEN2_VL_PATCH, spatial_merge_size=QWEN2_VL_MERGE,
                  temporal_patch_size=2)
    if version == "2.5":
        vision = dict(shared, hidden_size=32, out_hidden_size=COMMON["hidden_size"], intermediate_size=48,
                      window_size=2 * QWEN2_VL_PATCH * QWEN2_VL_MERGE, fullatt_block_indexes=[1], tokens_per_second=2)
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(shared, embed_dim=32, hidden_size=COMMON["hidden_size"], mlp_ratio=2)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                          vision_start_token_id=start, vision_end_token_id=end)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so argmax is robust
        model.lm_head.weight.normal_(0, 0.5)
        model.model.visual.merger.mlp[2].weight.normal_(0, 0.5)  # images that visibly steer the output
    model.save_pretrained(folder, safe_serialization=True)
    factor = QWEN2_VL_PATCH * QWEN2_VL_MERGE
    qwen2_vl_image_processor(min_pixels=factor * factor, max_pixels=48 * 48).save_pretrained(folder)
    return folder


def qwen2_vl_image_processor(**kwargs: Any) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=QWEN2_VL_PATCH, merge_size=QWEN2_VL_MERGE, temporal_patch_size=2,
                                    **kwargs)


def hf_qwen2_vl_processor(folder: Path) -> Any:
    """transformers' Qwen2VLProcessor for images (its text expansion and token types); built
    without a video processor, which needs torchvision."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLProcessor

    qwen2_5 = AutoConfig.from_pretrained(folder).model_type == "qwen2_5_vl"

    class ImagesOnly(Qwen2_5_VLProcessor if qwen2_5 else Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None  # the absent video processor is not checked

    processor = ImagesOnly(image_processor=AutoImageProcessor.from_pretrained(folder, backend="pil"),
                           tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None)
    processor.video_token = None  # a video's pad token stays one token (hf_qwen2_vl_greedy expands it)
    return processor


def hf_qwen2_vl_greedy(folder: Path, prompts: list[tuple[str, list[Any]]], max_new_tokens: int,
                       videos: dict[int, Any] | None = None) -> list[list[int]]:
    """Greedy tokens of transformers' Qwen2-VL for each ``(text, images)``, one prompt at a time.
    ``videos``: prompt index -> ``(pixel_values_videos, video_grid_thw)`` for its one video,
    whose pad token the processor leaves alone and this expands."""
    processor = hf_qwen2_vl_processor(folder)

    def add_video(index: int, inputs: dict[str, Any], config: Any) -> dict[str, Any]:
        return _with_video(inputs, config, *videos[index]) if videos and index in videos else inputs

    return _hf_greedy_each(folder, processor, prompts, max_new_tokens, add_video)


def _with_video(inputs: dict[str, Any], config: Any, pixels: Any, grid: Any) -> dict[str, Any]:
    """The video's pad token expanded to its grid's tokens (as Qwen2VLProcessor.replace_video_token),
    its tokens typed 2, and its tensors added (for Qwen2.5-VL, one second per temporal patch:
    2 frames sampled at the processor's 2 a second)."""
    import torch

    ids = inputs["input_ids"][0].tolist()
    at = ids.index(config.video_token_id)
    count = int(grid.prod()) // QWEN2_VL_MERGE ** 2
    ids = ids[:at] + [config.video_token_id] * count + ids[at + 1:]
    types = [1 if t == config.image_token_id else 2 if t == config.video_token_id else 0 for t in ids]
    return {**{k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")},
            "input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "mm_token_type_ids": torch.tensor([types]), "pixel_values_videos": pixels, "video_grid_thw": grid,
            **({"second_per_grid_ts": torch.tensor([1.0])} if config.model_type == "qwen2_5_vl" else {})}


def write_video(path: Path, frames: Any, fps: int) -> Path:
    """``frames`` ``[T, H, W, 3]`` uint8 as an H.264 mp4 at ``fps`` frames a second, with PyAV."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def random_frames(seed: int, count: int, height: int, width: int) -> Any:
    """Frames of a moving pattern (some change from frame to frame, as in a real video)."""
    import numpy as np

    base = np.random.default_rng(seed).integers(0, 256, (height, width + count, 3), dtype=np.uint8)
    return np.stack([base[:, i:i + width] for i in range(count)])


def hf_video_tensors(frames: Any) -> tuple[Any, Any]:
    """``(pixel_values_videos, video_grid_thw)`` as transformers' Qwen2VLVideoProcessor makes
    them from frames whose size needs no resize: rescaled and normalised with CLIP's mean and
    std, the last frame repeated to a whole temporal patch, and patched in its layout
    (video_processing_qwen2_vl.Qwen2VLVideoProcessor.patchify)."""
    import numpy as np
    import torch
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    video = torch.from_numpy((frames / 255.0 - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)).float()
    video = video.permute(0, 3, 1, 2)[None]  # [1, T, C, H, W]
    if pad := -video.shape[1] % 2:
        video = torch.cat([video, video[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
    _, frames_count, channels, height, width = video.shape
    t, h, w, m, p = frames_count // 2, height // QWEN2_VL_PATCH, width // QWEN2_VL_PATCH, QWEN2_VL_MERGE, QWEN2_VL_PATCH
    patches = video.view(1, t, 2, channels, h // m, m, p, w // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(t * h * w, channels * 2 * p * p), torch.tensor([[t, h, w]])


def decoded_frames(path: Path, fps: float) -> Any:
    """The frames of the file at ``path`` (PyAV), sampled as transformers' Qwen2-VL video
    processor samples at ``fps`` (at least 4 frames, an even count)."""
    import math

    import av
    import numpy as np

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        rate = float(stream.average_rate)
    total = len(frames)
    count = min(max(total / rate * fps, 4), math.floor(total / 2) * 2, total)
    count = math.floor(count / 2) * 2
    return frames[np.arange(0, total, total / count).astype(np.int32)]


# -- Gemma 3 -------------------------------------------------------------------
GEMMA3_IMAGE_SIZE, GEMMA3_PATCH = 32, 4  # an 8x8 patch grid, pooled to 4x4: 16 tokens an image
GEMMA3_IMAGE_TOKENS = 16
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
GEMMA3_IMAGE = GEMMA3_TOKENS["boi_token"]  # the placeholder the processor expands


def build_gemma3(folder: Path, seed: int = 0) -> Path:
    """A tiny random Gemma 3 with images (a 2-layer SigLIP tower 32 wide, the projector, and a
    3-layer Gemma 3 text decoder whose sliding layers see 8 tokens, fewer than an image's 16) and
    its Gemma3Processor, saved as a real folder is. The norms, head and projection are widened
    (transformers starts Gemma's norms at 0 and the projection at 0) so that images and the
    bidirectional mask over their tokens show in the greedy tokens."""
    import torch
    import transformers
    from family_models import GEMMA_ROPE
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = build_tokenizer(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>",
                                                     eos_token="</s>", pad_token="<pad>",
                                                     extra_special_tokens=dict(GEMMA3_TOKENS),
                                                     chat_template=tokenizer.chat_template)
    tokenizer.save_pretrained(folder)
    boi, image, eoi = (tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_TOKENS.values())
    text = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3, "head_dim": 16,
                                            "query_pre_attn_scalar": 24, "sliding_window": 8,
                                            "layer_types": ["sliding_attention", "full_attention",
                                                            "sliding_attention"],
                                            "rope_parameters": GEMMA_ROPE, "tie_word_embeddings": False})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=GEMMA3_IMAGE_SIZE,
                                             patch_size=GEMMA3_PATCH, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                                       boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
                                       tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name and "language_model" in name) or "mm_soft_emb_norm" in name:
                param.normal_(0.0, 0.3)  # w, applied as 1 + w
        model.lm_head.weight.normal_(0, 0.5)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    image_processor = Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE})
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                             image_seq_length=GEMMA3_IMAGE_TOKENS,
                                             chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    return folder


def hf_gemma3_greedy(folder: Path, prompts: list[tuple[str, list[Any]]], max_new_tokens: int,
                     bidirectional: bool = True) -> list[list[int]]:
    """Greedy tokens of transformers' Gemma 3 for each ``(text, images)``, one prompt at a time;
    ``bidirectional`` False drops the processor's ``token_type_ids``, so its image tokens attend
    causally (what the engine must not do)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, backend="pil")

    def drop_token_types(index: int, inputs: dict[str, Any], config: Any) -> dict[str, Any]:
        inputs.pop("token_type_ids", None)
        return inputs

    return _hf_greedy_each(folder, processor, prompts, max_new_tokens, None if bidirectional else drop_token_types)
