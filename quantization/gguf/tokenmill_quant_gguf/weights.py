"""GGUF tensors as HF-named torch tensors, one at a time: a linear layer's weight as its
stored blocks, every other tensor dequantised.

A 2-d weight belongs to a linear layer or the token embedding, whose GGUF method
(:mod:`tokenmill_quant_gguf.linear_method`, :mod:`~tokenmill_quant_gguf.embedding_method`)
takes it as two entries under the layer's prefix: ``qweight_type`` (a 0-d int64 tensor, the ggml type) and then
``qweight`` (the rows' raw bytes, uint8 ``[rows, bytes per row]``). Whether the
blocks stay quantized is that method's choice, not the file's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from tokenmill.plugin_api import WeightsIterator
from tokenmill_quant_gguf.blocks import block_geometry, dequantize_rows
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


def is_block_weight(hf_name: str, tensor: ReaderTensor) -> bool:
    """A 2-d weight: a linear layer's or the embedding's (norms and biases are 1-d)."""
    return hf_name.endswith(".weight") and len(tensor.shape) == 2


def raw_rows(tensor: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor's stored bytes as uint8 ``[rows, bytes per row]`` (a copy of the memory map)."""
    rows = int(tensor.shape[-1])  # ggml's ne is innermost first: the last is the row count
    data = np.ascontiguousarray(tensor.data)
    return torch.from_numpy(np.array(data.view(np.uint8).reshape(rows, -1), copy=True))


def iter_gguf_weights(tensors: Sequence[ReaderTensor], dtype: torch.dtype, qk_layout: QKLayout | None,
                      leaf_overrides: Mapping[str, str] | None = None,
                      norm_weight_offset: float = 0.0) -> WeightsIterator:
    """Yield ``(hf_name, tensor)`` for every tensor: a 2-d weight ``<layer>.weight`` as
    ``<layer>.qweight_type`` and ``<layer>.qweight`` (its rows in HF order, still blocks),
    every other tensor dequantised to ``dtype`` as :func:`iter_hf_weights` does (with the
    architecture's ``leaf_overrides`` and ``norm_weight_offset``)."""
    for tensor in tensors:
        hf_name = gguf_to_hf_name(tensor.name, leaf_overrides)
        if hf_name is None:
            continue
        if not is_block_weight(hf_name, tensor):
            yield from iter_hf_weights((tensor,), dtype, qk_layout, leaf_overrides, norm_weight_offset)
            continue
        rows = raw_rows(tensor)
        heads = qk_layout.heads_for(hf_name) if qk_layout is not None else None
        if heads is not None:
            rows = unpermute_rope_rows(rows, heads)  # whole rows move: the blocks run along them
        prefix = hf_name.removesuffix(".weight")
        yield f"{prefix}.qweight_type", torch.tensor(int(tensor.tensor_type), dtype=torch.int64)
        yield f"{prefix}.qweight", rows


def dequantized_weights(weights: WeightsIterator, dtype: torch.dtype = torch.float32) -> WeightsIterator:
    """:func:`iter_gguf_weights`' stream with every linear weight dequantised back to
    ``<layer>.weight`` in ``dtype``: the plain state dict a float model (transformers') loads."""
    qtypes: dict[str, GGMLQuantizationType] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "qweight_type":
            qtypes[prefix] = GGMLQuantizationType(int(tensor.item()))
        elif leaf == "qweight":
            qtype = qtypes.pop(prefix)
            in_features = tensor.shape[1] // block_geometry(qtype)[1] * block_geometry(qtype)[0]
            yield f"{prefix}.weight", dequantize_rows(tensor, qtype, in_features).to(dtype)
        else:
            yield name, tensor
