"""Hugging Face model folders: config.json, tokenizer files, safetensors weights
(a single file, or shards listed in ``model.safetensors.index.json``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tokenmill.errors import ModelNotFoundError
from tokenmill.model_loader.checkpoint import Checkpoint

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def iterate_safetensors(files: list[Path], dtype: torch.dtype,
                        keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files`` (or those whose name ``keep`` accepts: the others are never read)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if keep is not None and not keep(name):
                    continue
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if _is_float_to_cast(tensor) else tensor


def _is_float_to_cast(tensor: torch.Tensor) -> bool:
    """Float tensors take the model's dtype; 8-bit floats (an FP8 checkpoint's quantized
    weights) are quantized data that the quantization method reads as stored."""
    return tensor.is_floating_point() and tensor.element_size() > 1


def load_safetensors_folder(folder: Path, dtype: torch.dtype, tokenizer: str | None = None) -> Checkpoint:
    from transformers import AutoConfig, AutoTokenizer

    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{folder} has no config.json")
    hf_config = AutoConfig.from_pretrained(folder)
    files = safetensors_files(folder)
    tok = AutoTokenizer.from_pretrained(tokenizer or folder)
    generation = folder / "generation_config.json"
    return Checkpoint(
        path=folder,
        hf_config=hf_config,
        weights=lambda: iterate_safetensors(files, dtype),
        select_weights=lambda keep: iterate_safetensors(files, dtype, keep),
        tokenizer=tok,
        generation_config=json.loads(generation.read_text()) if generation.is_file() else {},
    )
