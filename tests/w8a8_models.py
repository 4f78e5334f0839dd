"""Tiny INT8 W8A8 checkpoints in compressed-tensors' ``int-quantized`` layout, and their
dequantised twins.

The test's own quantizer (the ``compressed-tensors`` package does not install
here): each decoder linear weight becomes an int8 ``weight`` (``round(W / s)``,
``s = max|W_row| / 127``, symmetric, per output channel) and a ``weight_scale`` of
shape ``[out, 1]``; ``config.json`` gets the ``quantization_config`` llm-compressor
writes for its W8A8 recipe (one group targeting ``Linear``: static per-channel
8-bit int weights, dynamic per-token 8-bit int activations, ``ignore:
["lm_head"]``). The packing follows compressed-tensors' int-quantized compressor
(the quantized values stored as int8 under the weight's own name, the scale
beside it), checked by reading the file back (int8 dtype, the scale's shape) and
by the dequantised weight lying within half a step of the original.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _args(strategy: str, dynamic: bool) -> dict[str, object]:
    return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": None, "block_structure": None, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


W8A8_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": _args("channel", False),
                                  "input_activations": _args("token", True), "output_activations": None}},
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [out, in], float32 scales [out, 1])``."""
    scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(weight.float() / scale).clamp(-127, 127).to(torch.int8), scale


def build_w8a8_pair(float_folder: Path, quantized: Path, dequantized: Path) -> None:
    """Write ``float_folder``'s model as a W8A8 checkpoint and as its dequantised twin."""
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(float_folder.glob("*.safetensors")):
        weights.update(load_file(file))
    int8: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in LINEAR:
            q, scale = quantize_per_channel(tensor)
            int8[name], int8[f"{prefix}.weight_scale"] = q, scale
            reference[name] = q.float() * scale
        else:
            int8[name] = reference[name] = tensor
    config = json.loads((float_folder / "config.json").read_text())
    for folder, tensors, extra in ((quantized, int8, {"quantization_config": W8A8_CONFIG}), (dequantized, reference, {})):
        shutil.copytree(float_folder, folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
