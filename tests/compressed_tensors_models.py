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

A scheme with static input activations (INT8 W8A8 ``strategy: "tensor"``, ``dynamic:
false``) needs each layer's ``input_scale`` (and, asymmetric, ``input_zero_point``):
they come from ``calculate_qparams`` on the layer's input min/max over a calibration
set run through transformers (what llm-compressor's min-max observer does), handed
to the compressor beside the weight's, which writes them as they are (and drops a
symmetric scheme's zero points, as it does for llm-compressor).
:func:`package_input_rounding` rounds a transformers model's linear inputs by the
package's own ``fake_quantize``: the activation rounding the checkpoint declares.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from gptq_models import LINEAR, write_pair

InputRange = tuple[torch.Tensor, torch.Tensor]  # a layer's calibrated input (min, max)


def preset(name: str, inputs: dict[str, Any] | None = None, **weights: Any) -> Any:
    """The package's preset scheme ``name`` for ``Linear`` layers, ``weights`` overriding fields of
    its weight arguments (``group_size=32``: the tiny model's 64 inputs hold no group of 128) and
    ``inputs`` those of its input activations (``{"symmetric": False}``)."""
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    scheme = preset_name_to_scheme(name, ["Linear"])
    if weights:
        scheme.weights = QuantizationArgs.model_validate({**scheme.weights.model_dump(), **weights})
    if inputs:
        scheme.input_activations = QuantizationArgs.model_validate({**scheme.input_activations.model_dump(),
                                                                    **inputs})
    return scheme


def has_static_inputs(scheme: Any) -> bool:
    return scheme.input_activations is not None and scheme.input_activations.dynamic is False


def quantization_config(scheme: Any, fmt: str) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head"])
    return json.loads(config.model_dump_json())


def compress_weight(weight: torch.Tensor, scheme: Any, fmt: str,
                    input_range: InputRange | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(the compressor's tensors for the layer, its decompressed [N, K] weight)``; ``input_range``:
    the layer's calibrated input, for a scheme with static input activations."""
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
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
    if has_static_inputs(scheme):
        if input_range is None:
            raise ValueError("a scheme with static input activations needs the layer's calibrated input range")
        state["input_scale"], state["input_zero_point"] = calculate_qparams(*input_range, scheme.input_activations)
    compressor = BaseCompressor.load_from_registry(fmt)
    compressed = compressor.compress(state, scheme)
    restored = compressor.decompress(dict(compressed), scheme)["weight"]
    return dict(compressed), restored.float()


def input_ranges(float_folder: Path, calibration: Iterable[list[int]], linear: tuple[str, ...]) -> dict[str, InputRange]:
    """Each linear layer's input (min, max) over the ``calibration`` prompts, run through transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32)
    ranges: dict[str, InputRange] = {}

    def record(name: str, x: torch.Tensor) -> None:
        low, high = x.min().reshape(1), x.max().reshape(1)
        if name in ranges:
            low, high = torch.minimum(low, ranges[name][0]), torch.maximum(high, ranges[name][1])
        ranges[name] = low, high

    for name, module in model.named_modules():
        if name.rpartition(".")[2] in linear:
            module.register_forward_pre_hook(lambda _module, args, name=name: record(name, args[0]))
    with torch.no_grad():
        for prompt in calibration:
            model(torch.tensor([prompt]))
    return ranges


def package_input_rounding(quantized: Path, scheme: Any) -> Callable[[torch.nn.Module], None]:
    """A ``prepare`` for tests/quant_agreement.py: each compressed layer's input rounded by the
    package's ``fake_quantize`` under ``scheme``'s input activations, at the checkpoint's
    ``input_scale`` / ``input_zero_point`` (static) or the package's per-token ones (dynamic)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file

    args = scheme.input_activations
    tensors = load_file(str(quantized / "model.safetensors"))

    def rounding(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], tuple[torch.Tensor]]:
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = inputs[0]
            if args.dynamic:
                scale, zero = compute_dynamic_scales_and_zp(x, args, module)
            else:
                scale, zero = tensors[f"{name}.input_scale"], tensors.get(f"{name}.input_zero_point")
            return (fake_quantize(x, scale, zero, args),)
        return hook

    def prepare(model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if f"{name}.weight_scale" in tensors:
                module.register_forward_pre_hook(rounding(name))

    return prepare


def build_compressed_pair(float_folder: Path, quantized: Path, dequantized: Path, scheme: Any, fmt: str,
                          linear: tuple[str, ...] = LINEAR, calibration: Iterable[list[int]] = ()) -> None:
    """``linear``: the layers compressed (a Mixtral's experts too with ``LINEAR + EXPERTS``);
    ``calibration``: the prompts a scheme with static input activations is calibrated on."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(float_folder.glob("*.safetensors")):
        weights.update(load_file(file))
    ranges = input_ranges(float_folder, calibration, linear) if has_static_inputs(scheme) else {}
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in linear:
            compressed, restored = compress_weight(tensor, scheme, fmt, ranges.get(prefix))
            packed.update({f"{prefix}.{key}": value for key, value in compressed.items()})
            reference[name] = restored
        else:
            packed[name] = reference[name] = tensor
    write_pair(float_folder, quantized, packed, dequantized, reference, quantization_config(scheme, fmt))
