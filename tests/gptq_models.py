"""Tiny GPTQ checkpoints in the on-disk layout AutoGPTQ / GPTQModel write, and their
dequantised twins.

The test's own quantizer (round to nearest per group, not GPTQ's Hessian-guided
rounding: the format, not the algorithm, is under test). Each decoder linear
weight ``W [N, K]`` becomes, for ``G = ceil(K / group_size)`` groups:

* ``g_idx`` int32 ``[K]``: ``k // group_size``, or with ``desc_act`` the groups of a
  random act-order permutation ``perm`` (``g_idx[perm[i]] = i // group_size``, as
  AutoGPTQ stores it: the weight stays in the original input order);
* per group and output row, min/max over the group's inputs (the range widened to
  hold 0, as GPTQ's quantizer does): ``scale = (max - min) / maxq``, rounded to
  float16, and ``zero = round(-min / scale)``; symmetric: ``max = max|W|``,
  ``scale = 2 max / maxq`` and ``zero = (maxq + 1) / 2``;
* ``qweight`` int32 ``[K / p, N]`` (``q = clamp(round(W / scale) + zero, 0, maxq)``,
  ``p = 32 / bits`` values a word, packed along the input, the first in the lowest
  bits), ``qzeros`` int32 ``[G, N / p]`` (packed along the output; ``zero - 1`` in
  the v1 format ``checkpoint_format: "gptq"``, ``zero`` in ``"gptq_v2"``),
  ``scales`` float16 ``[G, N]``.

The twin holds ``scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])`` in float32.
The packing is checked against AutoGPTQ's own ``QuantLinear.pack`` (qweight and the
v1 qzeros, bit for bit) and the ``compressed-tensors`` package's int32 packer
(``pack_to_int32``: the same low-bits-first order) in
quantization/gptq/tests/test_gptq_checkpoints.py.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERTS = ("w1", "w2", "w3")  # Mixtral's experts.N.<name> (the others' experts use LINEAR's names)


@dataclass(frozen=True)
class GptqRecipe:
    bits: int = 4
    group_size: int = 32
    sym: bool = False
    desc_act: bool = False
    checkpoint_format: str = "gptq"

    def config(self) -> dict[str, object]:
        """The ``quantization_config`` GPTQModel writes (the fields tokenmill reads, and a few it does not)."""
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": self.checkpoint_format, "lm_head": False,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False}


@dataclass(frozen=True)
class GptqLayer:
    q: torch.Tensor  # [K, N] unsigned values
    zeros: torch.Tensor  # [G, N] real zeros
    scales: torch.Tensor  # [G, N] float16
    g_idx: torch.Tensor  # [K] int32

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32, the layout of the float weight."""
        g = self.g_idx.long()
        return ((self.q - self.zeros[g]).float() * self.scales[g].float()).t().contiguous()


def act_order(projection: str, inputs: int, seed: int) -> torch.Tensor:
    """A random permutation standing in for GPTQ's order of decreasing Hessian diagonal. The
    projections of one input (q/k/v, gate/up) share its Hessian and so its order."""
    owner, _, proj = projection.rpartition(".")
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up",
              "w1": "gate_up", "w3": "gate_up"}
    key = f"{owner}.{shared.get(proj, proj)}"
    return torch.randperm(inputs, generator=torch.Generator().manual_seed(seed + sum(map(ord, key)) * 7919))


def quantize(weight: torch.Tensor, recipe: GptqRecipe, order: torch.Tensor | None = None) -> GptqLayer:
    """``order``: the act-order permutation (with ``desc_act``)."""
    n, k = weight.shape
    maxq = 2 ** recipe.bits - 1
    size = k if recipe.group_size == -1 else recipe.group_size
    if order is None:
        order = torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // size).to(torch.int32)
    groups = math.ceil(k / size)
    w = weight.float().t()  # [K, N]
    q = torch.empty(k, n, dtype=torch.int32)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        rows = (g_idx == g).nonzero().flatten()
        block = w[rows]
        lo, hi = block.min(dim=0).values.clamp(max=0), block.max(dim=0).values.clamp(min=0)
        if recipe.sym:
            scale = (2 * torch.maximum(-lo, hi) / maxq).half()
            zero = torch.full((n,), (maxq + 1) // 2, dtype=torch.int32)
        else:
            scale = ((hi - lo) / maxq).half()
            zero = torch.round(-lo / scale.float()).clamp(0, maxq).to(torch.int32)
            if recipe.checkpoint_format == "gptq" and (zero == 0).any():
                raise ValueError("a zero of 0 cannot be stored in the v1 format (zero - 1 would be -1)")
        scales[g], zeros[g] = scale, zero
        q[rows] = torch.round(block / scale.float()).add(zero).clamp(0, maxq).to(torch.int32)
    return GptqLayer(q, zeros, scales, g_idx)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` unsigned values -> ``[R / p, C]`` int32 words, packed along the rows (numpy's
    uint32 arithmetic, independent of the plugin's torch packer)."""
    import numpy as np

    per_word = 32 // bits
    v = values.numpy().astype(np.uint32).reshape(-1, per_word, values.shape[1])
    words = np.zeros((v.shape[0], v.shape[2]), dtype=np.uint32)
    for j in range(per_word):
        words |= v[:, j, :] << np.uint32(bits * j)
    return torch.from_numpy(words.view(np.int32).copy())


def pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_rows(values.t().contiguous(), bits).t().contiguous()


def gptq_tensors(layer: GptqLayer, recipe: GptqRecipe) -> dict[str, torch.Tensor]:
    stored_zeros = layer.zeros - 1 if recipe.checkpoint_format == "gptq" else layer.zeros
    return {"qweight": pack_rows(layer.q, recipe.bits), "qzeros": pack_columns(stored_zeros, recipe.bits),
            "scales": layer.scales, "g_idx": layer.g_idx}


def build_gptq_pair(float_folder: Path, quantized: Path, dequantized: Path, recipe: GptqRecipe, seed: int = 0,
                    linear: tuple[str, ...] = LINEAR) -> None:
    """Write ``float_folder``'s model as a GPTQ checkpoint and as its dequantised twin; the
    weights quantized are those of the layers named in ``linear`` (a MoE model's experts
    too: ``LINEAR + EXPERTS`` for Mixtral; the routers stay float, as GPTQ leaves them)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(float_folder.glob("*.safetensors")):
        weights.update(load_file(file))
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in linear:
            layer = quantize(tensor, recipe, act_order(prefix, tensor.shape[1], seed) if recipe.desc_act else None)
            packed.update({f"{prefix}.{key}": value for key, value in gptq_tensors(layer, recipe).items()})
            reference[name] = layer.dequantized()
        else:
            packed[name] = reference[name] = tensor
    write_pair(float_folder, quantized, packed, dequantized, reference, recipe.config())


def write_pair(float_folder: Path, quantized: Path, packed: dict[str, torch.Tensor], dequantized: Path,
               reference: dict[str, torch.Tensor], quantization_config: dict[str, object]) -> None:
    """The quantized checkpoint (with ``quantization_config``) and its float twin, beside the tokenizer."""
    from safetensors.torch import save_file

    config = json.loads((float_folder / "config.json").read_text())
    for folder, tensors, extra in ((quantized, packed, {"quantization_config": quantization_config}),
                                   (dequantized, reference, {})):
        shutil.copytree(float_folder, folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
