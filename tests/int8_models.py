"""Tiny checkpoints in the example int8 plugin's format, and their dequantised twins.

Each linear weight of a float checkpoint is quantized per output channel
(``scale = max|w_row| / 127``, ``q = round(w / scale)``) and stored as
``<prefix>.qweight`` + ``<prefix>.scales``; the twin holds ``q * scale`` as plain
float weights, for transformers to run as the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

CHECKPOINT_ALIAS = "example_int8"  # tokenmill_example_int8.CHECKPOINT_ALIAS
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [out, in], float32 scales [out])``."""
    scales = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def build_int8_pair(float_folder: Path, quantized: Path, dequantized: Path,
                    ignored_layers: tuple[str, ...] = ()) -> None:
    """Write ``float_folder``'s model as an int8 checkpoint and as its dequantised twin."""
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(float_folder.glob("*.safetensors")):
        weights.update(load_file(file))
    int8: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        ignored = any(prefix == p or prefix.startswith(p + ".") for p in ignored_layers)
        if leaf == "weight" and prefix.rpartition(".")[2] in _LINEAR and not ignored:
            q, scales = quantize_per_channel(tensor)
            int8[f"{prefix}.qweight"], int8[f"{prefix}.scales"] = q, scales
            reference[name] = q.float() * scales[:, None]
        else:
            int8[name] = reference[name] = tensor
    config = json.loads((float_folder / "config.json").read_text())
    for folder, tensors, quantization in ((quantized, int8, {"quant_method": CHECKPOINT_ALIAS,
                                                            "ignored_layers": list(ignored_layers)}),
                                          (dequantized, reference, None)):
        shutil.copytree(float_folder, folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}
                                                       if quantization else config))
