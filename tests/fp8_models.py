"""Tiny FP8 checkpoints in the on-disk layout of vLLM / transformers ``fp8`` checkpoints,
and their dequantised twins.

The test's own quantizer (no FP8 tool installs here): every decoder linear weight
becomes a float8_e4m3fn ``weight`` plus, by ``scheme``,

* ``per-tensor``: ``weight_scale`` of shape ``[]`` (``max|W| / 448``), as vLLM's and
  AutoFP8's checkpoints store it, one per q/k/v and gate/up projection;
* ``per-channel``: ``weight_scale`` ``[out, 1]`` (``max|W_row| / 448``);
* ``static``: per-tensor weights plus ``input_scale`` ``[]`` (``max|x| / 448`` over the
  layer's inputs on a calibration batch run through transformers);
* ``block``: ``weight_scale_inv`` ``[ceil(out / b), ceil(in / b)]``, one per ``b x b``
  block (DeepSeek-V3 / Qwen3-FP8 name it so: the scale that multiplies back), with
  ``weight_block_size: [b, b]``.

The lm_head is listed in ``ignored_layers`` and stays float, as in those
checkpoints. The twin holds ``weight.float() * scale`` as plain float32 weights.
The packing was checked against the format's definition rather than a tool:
``safetensors`` stores the tensors with dtype ``F8_E4M3`` (read back by
``safe_open``), and the dequantised weight is within e4m3's rounding
(relative 2**-4) of the original (``test_the_checkpoint_holds_fp8_within_rounding``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = ("per-tensor", "per-channel", "static", "block")


def quantize(weight: torch.Tensor, scheme: str, block: int) -> tuple[torch.Tensor, str, torch.Tensor, torch.Tensor]:
    """``(fp8 weight, scale name, stored scale, scale broadcast to the weight)``."""
    w = weight.float()
    if scheme in ("per-tensor", "static"):
        scale = (w.abs().max() / FP8_MAX).reshape(())
        full = scale.expand_as(w)
        name = "weight_scale"
    elif scheme == "per-channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale.expand_as(w)
        name = "weight_scale"
    else:
        n, k = w.shape
        rows, cols = -(-n // block), -(-k // block)
        padded = torch.nn.functional.pad(w.abs(), (0, cols * block - k, 0, rows * block - n))
        scale = padded.view(rows, block, cols, block).amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        name = "weight_scale_inv"
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, name, scale.contiguous(), full


def input_amax(float_folder: Path, prompts: Iterable[list[int]]) -> dict[str, float]:
    """``max|x|`` of each linear layer's input over ``prompts`` (the static calibration)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32)
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LINEAR:
            def record(_module, args, _out, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return amax


MERGED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def static_input_rounding(quantized: Path) -> Callable[[torch.nn.Module], None]:
    """A ``prepare`` for tests/quant_agreement.py: rounds each linear layer's input the
    way the static scheme does (to e4m3 at the checkpoint's ``input_scale``; q/k/v and
    gate/up, which share an input, at the largest of their scales)."""
    from safetensors.torch import load_file

    scales = {name.removesuffix(".input_scale"): float(t) for name, t in
              load_file(str(quantized / "model.safetensors")).items() if name.endswith(".input_scale")}
    shared: dict[str, float] = {}
    for prefix, scale in scales.items():
        owner, _, proj = prefix.rpartition(".")
        key = f"{owner}.{MERGED.get(proj, proj)}"
        shared[key] = max(shared.get(key, 0.0), scale)

    def prepare(model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if name in scales:
                owner, _, proj = name.rpartition(".")
                scale = shared[f"{owner}.{MERGED.get(proj, proj)}"]
                module.register_forward_pre_hook(
                    lambda _m, args, scale=scale: ((args[0] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale,))

    return prepare


def build_fp8_pair(float_folder: Path, quantized: Path, dequantized: Path, scheme: str, block: int = 32,
                   calibration: Iterable[list[int]] = (), linear: tuple[str, ...] = LINEAR) -> None:
    """Write ``float_folder``'s model as an FP8 checkpoint of ``scheme`` and as its dequantised
    twin; ``linear``: the layers quantized (a Mixtral's experts too with ``LINEAR + ("w1", "w2", "w3")``)."""
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(float_folder.glob("*.safetensors")):
        weights.update(load_file(file))
    amax = input_amax(float_folder, calibration) if scheme == "static" else {}
    fp8: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in linear:
            q, scale_name, scale, full = quantize(tensor, scheme, block)
            fp8[name], fp8[f"{prefix}.{scale_name}"] = q, scale
            if scheme == "static":
                fp8[f"{prefix}.input_scale"] = torch.tensor(amax[prefix] / FP8_MAX)
            reference[name] = q.float() * full
        else:
            fp8[name] = reference[name] = tensor
    quantization: dict[str, object] = {"quant_method": "fp8", "ignored_layers": ["lm_head"],
                                       "activation_scheme": "static" if scheme == "static" else "dynamic"}
    if scheme == "block":
        quantization["weight_block_size"] = [block, block]
    config = json.loads((float_folder / "config.json").read_text())
    for folder, tensors, extra in ((quantized, fp8, {"quantization_config": quantization}), (dequantized, reference, {})):
        shutil.copytree(float_folder, folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
