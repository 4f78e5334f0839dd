"""Dequantising GGUF tensors into HF-named torch tensors, one at a time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import ReaderTensor
from gguf.quants import dequantize

from tokenmill.plugin_api import WeightsIterator
from tokenmill_quant_gguf.rope_permute import unpermute_rope_rows
from tokenmill_quant_gguf.tensor_names import gguf_to_hf_name


@dataclass(frozen=True)
class QKLayout:
    """Head counts for undoing llama.cpp's q/k row permutation.

    Loaders pass ``None`` instead for architectures llama.cpp does not permute.
    """

    num_heads: int
    num_kv_heads: int

    def heads_for(self, hf_name: str) -> int | None:
        if ".self_attn.q_proj." in hf_name:
            return self.num_heads
        if ".self_attn.k_proj." in hf_name:
            return self.num_kv_heads
        return None


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32, in torch dimension order."""
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = values.reshape(shape)
    if not values.flags.writeable:
        # F32/F16 tensors come back as views of the read-only memory map.
        values = np.array(values, copy=True)
    return torch.from_numpy(values)


def iter_hf_weights(tensors: Sequence[ReaderTensor], dtype: torch.dtype, qk_layout: QKLayout | None,
                    leaf_overrides: Mapping[str, str] | None = None, norm_weight_offset: float = 0.0) -> WeightsIterator:
    """Yield ``(hf_name, tensor)`` for every tensor, dequantised to ``dtype``.
    ``leaf_overrides`` and ``norm_weight_offset`` (added to every norm weight, in float32)
    are the architecture's (:class:`~tokenmill_quant_gguf.architectures.GGUFArchitecture`).

    Only one dequantised tensor is alive at a time on our side; the quantized
    bytes stay in the memory-mapped file until read.
    """
    for tensor in tensors:
        hf_name = gguf_to_hf_name(tensor.name, leaf_overrides)
        if hf_name is None:
            continue
        values = dequantize_tensor(tensor)
        if norm_weight_offset and hf_name.endswith("norm.weight"):
            values = values + norm_weight_offset
        values = values.to(dtype)
        heads = qk_layout.heads_for(hf_name) if qk_layout is not None else None
        if heads is not None:
            values = unpermute_rope_rows(values, heads)
        yield hf_name, values
