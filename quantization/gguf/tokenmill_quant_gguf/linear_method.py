"""The GGUF linear method: a layer's weight kept as the file's quantized blocks.

The loader (:func:`tokenmill_quant_gguf.weights.iter_gguf_weights`) gives each linear
weight as ``qweight_type`` then ``qweight`` (raw block rows), once per shard of a
merged layer (q/k/v, gate/up). Shards can differ in type (llama.cpp's mixes put
``attn_v`` in a wider type than ``attn_q``), so each is held as it comes until all
are loaded; :meth:`GGUFLinearMethod.process_weights_after_loading` then settles the
layer's form:

- every shard of one type in :data:`~tokenmill_quant_gguf.blocks.KEPT_QUANTIZED` (Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
  (and the method not told to dequantise): the rows are joined into one uint8
  ``qweight`` ``[out, bytes per row]`` that :func:`~tokenmill_quant_gguf.kernels.gguf_linear`
  multiplies by, dequantising block by block;
- otherwise (other types, float tensors, mixed shards, ``dequantize=True``): the
  shards are dequantised into a float ``weight`` of the params dtype, multiplied as a
  float layer's.

Under tensor parallelism each rank keeps its rows of a column-parallel layer and its
blocks of a row-parallel one's input (whole blocks only: a split inside a block is
refused at load).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch
from gguf import GGMLQuantizationType
from torch import nn

from tokenmill.layers import Linear, layer_ops
from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, block_geometry, dequantize_rows, row_bytes
from tokenmill_quant_gguf.kernels import gguf_linear

logger = logging.getLogger(__name__)


class GGUFLinearMethod:
    """One layer's GGUF weight; ``dequantize``: always dequantise it at load."""

    def __init__(self, dequantize: bool = False) -> None:
        self.dequantize = dequantize
        self.qtype: GGMLQuantizationType | None = None  # set when the layer keeps its blocks
        self._types: dict[int, GGMLQuantizationType] = {}
        self._rows: dict[int, torch.Tensor] = {}

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        # Placeholders: the loaded tensors' shapes depend on their type, known only when they come.
        layer.add_parameter("qweight_type", torch.empty(0, dtype=torch.int64),
                            weight_loader=self._loader(layer, self._load_type))
        layer.add_parameter("qweight", torch.empty(0, dtype=torch.uint8), output_dim=0,
                            weight_loader=self._loader(layer, self._load_rows))

    def _loader(self, layer: Linear, load: Callable[[Linear, nn.Parameter, torch.Tensor, int], None]) -> Callable[..., None]:
        def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
            load(layer, param, loaded, 0 if shard_id is None else shard_id)
        return weight_loader

    def _load_type(self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        self._types[shard] = GGMLQuantizationType(int(loaded.item()))

    def _load_rows(self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        qtype = self._types.get(shard)
        if qtype is None:
            raise ValueError(f"{layer.prefix}: block rows of shard {shard} came before their qweight_type")
        expected_rows = layer.output_partition_sizes[shard]
        full_k = layer.in_features * (layer.output_loader.world_size if layer.parallel == "row" else 1)
        row_bytes(qtype, full_k)  # refuses a K that is not whole blocks
        loaded = layer.output_loader.rank_slice(param, loaded, shard)
        if layer.parallel == "row":
            loaded = _input_blocks(layer, loaded, qtype)
        if loaded.shape != (expected_rows, row_bytes(qtype, layer.in_features)):
            raise ValueError(f"{layer.prefix}: {qtype.name} rows of shape {tuple(loaded.shape)} for shard {shard} "
                             f"of {expected_rows} rows of {layer.in_features} input features")
        self._rows[shard] = loaded.contiguous()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        linear = cast(Linear, layer)
        shards = range(len(linear.output_partition_sizes))
        missing = [shard for shard in shards if shard not in self._rows]
        if missing:
            raise ValueError(f"{linear.prefix}: no GGUF rows loaded for shards {missing}")
        types = {self._types[shard] for shard in shards}
        rows = [self._rows[shard] for shard in shards]
        del linear.qweight_type, linear.qweight
        if len(types) == 1 and not self.dequantize and (qtype := types.pop()) in KEPT_QUANTIZED:
            self.qtype = qtype
            linear.register_buffer("qweight", torch.cat(rows) if len(rows) > 1 else rows[0])
        else:
            weight = torch.cat([dequantize_rows(part, self._types[shard], linear.in_features)
                                for shard, part in zip(shards, rows, strict=True)])
            weight = linear.add_parameter("weight", weight.to(linear.params_dtype), output_dim=0, input_dim=1)
            linear.register_buffer("prepared_weight", layer_ops(weight.device).prepare_linear_weight(weight),
                                   persistent=False)
            reason = "as asked" if self.dequantize else "no kernel keeps this type (or mix of types) quantized"
            logger.debug("%s: GGUF %s weights dequantised at load, %s", linear.prefix,
                         "/".join(sorted({t.name for t in self._types.values()})), reason)
        self._types, self._rows = {}, {}

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        bias = cast(torch.Tensor | None, layer.bias)
        if self.qtype is None:
            return layer_ops(x.device).linear(x, cast(torch.Tensor, layer.weight), bias,
                                              cast(torch.Tensor | None, layer.prepared_weight))
        return gguf_linear(x, cast(torch.Tensor, layer.qweight), self.qtype, layer.in_features, bias)


def _input_blocks(layer: Linear, loaded: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A row-parallel rank's slice of the input: its ``in_features`` values, as whole blocks."""
    size, nbytes = block_geometry(qtype)
    if layer.in_features % size:
        raise ValueError(f"{layer.prefix}: {layer.in_features} input features per rank split {qtype.name} blocks "
                         f"of {size} values; run with a tensor-parallel size that keeps blocks whole")
    width = layer.in_features // size * nbytes
    return loaded.narrow(1, layer.output_loader.rank * width, width)

