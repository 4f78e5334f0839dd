"""Tiny AWQ checkpoints in the on-disk layout AutoAWQ's GEMM kernels use, and their
dequantised twins.

The test's own quantizer (round to nearest per group without AWQ's activation-aware
scale search: the format, not the algorithm, is under test), following AutoAWQ's
``pseudo_quantize_tensor``: per output row and group of ``group_size`` inputs,
``scale = (max - min) / 15`` (rounded to float16), ``zero = clamp(-round(min /
scale), 0, 15)``, ``q = clamp(round(W / scale) + zero, 0, 15)``. Then, as AutoAWQ's
``WQLinear_GEMM.from_linear`` packs them, ``qweight`` int32 ``[K, N / 8]`` and
``qzeros`` int32 ``[G, N / 8]``: nibble ``i`` (bits ``4i .. 4i + 3``) of word ``c``
holds column ``8c + AWQ_ORDER[i]``, ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``;
``scales`` float16 ``[G, N]``. The twin holds ``scale * (q - zero)`` in float32.
The packing is written here with numpy, independently of the plugin, and checked
by reading nibbles back by hand (quantization/awq/tests/test_awq_checkpoints.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from gptq_models import LINEAR, write_pair

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_config(group_size: int) -> dict[str, object]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [K, N], zeros [G, N], scales float16 [G, N])`` of an ``[N, K]`` weight."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(lo / scales.float())).clamp(0, 15).to(torch.int32)
    q = (torch.round(w / scales.float()[..., None]) + zeros[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k).t().contiguous(), zeros.t().contiguous(), scales.t().contiguous()


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` 4-bit values -> ``[R, C / 8]`` int32 words in AWQ's interleaved order."""
    import numpy as np

    v = values.numpy().astype(np.uint32).reshape(values.shape[0], -1, 8)
    words = np.zeros(v.shape[:2], dtype=np.uint32)
    for nibble, column in enumerate(AWQ_ORDER):
        words |= v[:, :, column] << np.uint32(4 * nibble)
    return torch.from_numpy(words.view(np.int32).copy())


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, K]`` float32."""
    g = torch.arange(q.shape[0]) // group_size
    return ((q - zeros[g]).float() * scales[g].float()).t().contiguous()


def build_awq_pair(float_folder: Path, quantized: Path, dequantized: Path, group_size: int,
                   linear: tuple[str, ...] = LINEAR) -> None:
    """``linear``: the layers quantized (a Mixtral's experts too with ``LINEAR + EXPERTS``)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(float_folder.glob("*.safetensors")):
        weights.update(load_file(file))
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in linear:
            q, zeros, scales = quantize(tensor, group_size)
            packed.update({f"{prefix}.qweight": pack_awq(q), f"{prefix}.qzeros": pack_awq(zeros),
                           f"{prefix}.scales": scales})
            reference[name] = dequantize(q, zeros, scales, group_size)
        else:
            packed[name] = reference[name] = tensor
    write_pair(float_folder, quantized, packed, dequantized, reference, awq_config(group_size))
