"""Videos for Qwen2-VL without torchvision: frames decoded with PyAV, sampled at the
processor's rate, and patched as transformers' ``Qwen2VLVideoProcessor`` lays them out.

Each frame goes through the model's image processor (its resize, rescale and normalise),
which gives it as ``temporal_patch_size`` equal copies in every patch; a video patch takes
slice ``j`` of its ``j``-th frame in each group of ``temporal_patch_size`` frames instead
(the last frame repeated to fill the last group), in the same patch order.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.plugin_api import InvalidRequestError

_PARAM = "multi_modal_data"
# The sampling of transformers' Qwen2-VL video processor, as vLLM applies it to decoded files.
SAMPLING_DEFAULTS = {"fps": 2.0, "min_frames": 4, "max_frames": 768}
SAMPLING_OPTIONS = frozenset({"fps", "min_frames", "max_frames", "num_frames"})


def load_video(video: Any, temporal_patch_size: int, sampling: Mapping[str, Any] | None = None) -> list[Any]:
    """The frames of ``video``: given as frames (a list of PIL images or ``[H, W, 3]`` arrays,
    or one ``[T, H, W, 3]`` uint8 array) they are used as they are; a file (a path, or its
    bytes) is decoded and sampled at ``fps`` frames a second (``sampling`` overrides
    :data:`SAMPLING_DEFAULTS`, or gives ``num_frames``)."""
    if isinstance(video, np.ndarray) and video.ndim == 4:
        return list(video)
    if isinstance(video, (list, tuple)):
        if not video:
            raise InvalidRequestError("a video needs at least one frame", param=_PARAM)
        return list(video)
    if isinstance(video, (str, Path, bytes)):
        frames, fps = decode_video(video)
        return [frames[i] for i in sample_indices(len(frames), fps, temporal_patch_size, sampling or {})]
    raise InvalidRequestError(f"a video is a list of frames, a [T, H, W, 3] array, a file path or its bytes, "
                              f"not {type(video).__name__}", param=_PARAM)


def decode_video(source: str | Path | bytes) -> tuple[list[np.ndarray], float]:
    """Every frame of the file (RGB ``[H, W, 3]`` uint8) and its frame rate."""
    import av

    try:
        with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source), mode="r") as container:
            stream = container.streams.video[0]
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
            rate = stream.average_rate or stream.guessed_rate
    except (av.FFmpegError, IndexError, OSError) as exc:
        raise InvalidRequestError(f"the video cannot be decoded: {exc}", param=_PARAM) from exc
    if not frames:
        raise InvalidRequestError("the video holds no frames", param=_PARAM)
    return frames, float(rate) if rate else 1.0


def sample_indices(total: int, fps: float, temporal_patch_size: int, sampling: Mapping[str, Any]) -> list[int]:
    """Which of ``total`` frames to keep: evenly spread, ``fps`` a second within
    ``[min_frames, max_frames]`` (or ``num_frames``), a multiple of ``temporal_patch_size``
    where the video has that many."""
    options = {**SAMPLING_DEFAULTS, **sampling}
    count: float
    if options.get("num_frames") is not None:
        count = int(options["num_frames"])
    else:
        largest = min(int(options["max_frames"]), total)
        count = min(max(total / fps * float(options["fps"]), int(options["min_frames"])), largest)
    count = min(max(math.floor(count / temporal_patch_size) * temporal_patch_size, 1), total)
    return [int(i) for i in np.arange(0, total, total / count)[:count]]


def video_patches(frames: list[Any], image_processor: Any, options: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values_videos [t*h*w, C*T*P*P], video_grid_thw [1, 3])`` of ``frames``."""
    from PIL import Image

    images = [frame if isinstance(frame, Image.Image) else Image.fromarray(np.asarray(frame, dtype=np.uint8))
              for frame in frames]
    images = [image.convert("RGB") for image in images]
    if len({image.size for image in images}) != 1:
        raise InvalidRequestError("the frames of a video must all have one size", param=_PARAM)
    out = image_processor(images=images, return_tensors="pt", **options)
    step = int(image_processor.temporal_patch_size)
    channels = out["pixel_values"].shape[1] // (step * int(image_processor.patch_size) ** 2)
    _, h, w = (int(v) for v in out["image_grid_thw"][0].tolist())
    # [frames, patches, C, T, P, P]: each frame's patches, its T copies equal
    per_frame = out["pixel_values"].view(len(images), h * w, channels, step, -1)
    pad = -len(images) % step
    frame_index = torch.cat([torch.arange(len(images)), torch.full((pad,), len(images) - 1)])
    groups = frame_index.view(-1, step)  # [t, T]: the frames of each temporal patch
    slices = torch.arange(step)
    patches = per_frame[groups, :, :, slices]  # [t, T, patches, C, P*P]: slice j of frame j of each group
    patches = patches.permute(0, 2, 3, 1, 4)  # [t, patches, C, T, P*P]
    grid = torch.tensor([[groups.shape[0], h, w]], dtype=out["image_grid_thw"].dtype)
    return patches.reshape(groups.shape[0] * h * w, -1).contiguous(), grid
