"""Tiny compressed-tensors checkpoints written by the ``compressed-tensors`` package itself,
and their dequantised twins.

For each decoder linear weight, the scale and zero point come from the package's
``calculate_qparams`` on the weight's min/max (per channel or per group, as the
scheme's strategy says: what llm-compressor's min-max observer feeds it), and the
package's registered compressor for the format (``pack-quantized``,
``int-quantized``, ``float-quantized``) writes the tensors (``compress``); the
same compressor's ``decompress`` gives the twin's float weights. The
``quantization_config`` is the package's ``QuantizationConfig`` serialized, with a
preset scheme (``W4A16``, ``W8A8``, ``FP8_DYNAMIC``, ...) targeting ``Linear`` and
``ignore: ["lm_head"]``. Nothing here packs or rounds by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from gptq_models import LINEAR, write_pair


def preset(name: str, **weights: Any) -> Any:
    """The package's preset scheme ``name`` for ``Linear`` layers, ``weights`` overriding fields of
    its weight arguments (``group_size=32``: the tiny model's 64 inputs hold no group of 128)."""
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    scheme = preset_name_to_scheme(name, ["Linear"])
    if weights:
        scheme.weights = QuantizationArgs.model_validate({**scheme.weights.model_dump(), **weights})
    return scheme


def quantization_config(scheme: Any, fmt: str) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head"])
    return json.loads(config.model_dump_json())


def compress_weight(weight: torch.Tensor, scheme: Any, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(the compressor's tensors for the layer, its decompressed [N, K] weight)``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args, w = scheme.weights, weight.float()
    if args.strategy == "group":
        grouped = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)
    elif args.strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    scale, zero_point = calculate_qparams(lo, hi, args)
    compressor = BaseCompressor.load_from_registry(fmt)
    compressed = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    restored = compressor.decompress(dict(compressed), scheme)["weight"]
    return dict(compressed), restored.float()


def build_compressed_pair(float_folder: Path, quantized: Path, dequantized: Path, scheme: Any, fmt: str,
                          linear: tuple[str, ...] = LINEAR) -> None:
    """``linear``: the layers compressed (a Mixtral's experts too with ``LINEAR + EXPERTS``)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(float_folder.glob("*.safetensors")):
        weights.update(load_file(file))
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in linear:
            compressed, restored = compress_weight(tensor, scheme, fmt)
            packed.update({f"{prefix}.{key}": value for key, value in compressed.items()})
            reference[name] = restored
        else:
            packed[name] = reference[name] = tensor
    write_pair(float_folder, quantized, packed, dequantized, reference, quantization_config(scheme, fmt))
