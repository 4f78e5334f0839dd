"""The GGUF linear method: a layer's weight kept as the file's quantized blocks.

The loader (:func:`tokenmill_quant_gguf.weights.iter_gguf_weights`) gives each linear
weight as ``qweight_type`` then ``qweight`` (raw block rows), once per shard of a
merged layer (q/k/v, gate/up). Shards can differ in type (llama.cpp's mixes put
``attn_v`` in a wider type than ``attn_q``: Q4_K_M stores q/k as Q4_K and v as Q6_K),
so each is held as it comes until all are loaded;
:meth:`GGUFLinearMethod.process_weights_after_loading` then settles the layer's form:

- every shard of a type in :data:`~tokenmill_quant_gguf.blocks.KEPT_QUANTIZED` (Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) (and the method not told to dequantise): the
  layer keeps its blocks. Consecutive shards of one type form one :class:`BlockPart`
  (q and k of Q4_K_M are one part, v another); all parts' bytes are one flat uint8
  ``qweight`` buffer, and :meth:`GGUFLinearMethod.apply` runs
  :func:`~tokenmill_quant_gguf.kernels.gguf_linear` once per part (once for a layer of
  one type, whose ``qweight`` is then ``[out, bytes per row]``), each computing its
  columns of the output;
- otherwise (other types, float tensors, ``dequantize=True``): the shards are
  dequantised into a float ``weight`` of the params dtype, multiplied as a float layer's.

Under tensor parallelism each rank keeps its rows of a column-parallel layer and its
blocks of a row-parallel one's input (whole blocks only: a split inside a block is
refused at load).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import cast

import torch
from gguf import GGMLQuantizationType
from torch import nn

from tokenmill.layers import Linear, layer_ops
from tokenmill_quant_gguf.blocks import KEPT_QUANTIZED, block_geometry, dequantize_rows, row_bytes
from tokenmill_quant_gguf.kernels import Activations, gguf_linear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockPart:
    """Consecutive output shards of one block type: output features ``first_row ..
    first_row + rows``, whose block rows of ``row_bytes`` bytes each start at byte
    ``offset`` of the layer's ``qweight``."""

    qtype: GGMLQuantizationType
    first_row: int
    rows: int
    offset: int
    row_bytes: int

    def rows_of(self, qweight: torch.Tensor) -> torch.Tensor:
        """This part's uint8 ``[rows, row_bytes]`` block rows: a view of ``qweight``."""
        return qweight.view(-1).narrow(0, self.offset, self.rows * self.row_bytes).view(self.rows, self.row_bytes)


def block_parts(types: Sequence[GGMLQuantizationType], sizes: Sequence[int], in_features: int) -> tuple[BlockPart, ...]:
    """The parts of a layer whose output shards have ``sizes`` features of block ``types``:
    each run of shards of one type is one part (one kernel call)."""
    parts: list[BlockPart] = []
    first_row = offset = 0
    for qtype, run in groupby(zip(types, sizes, strict=True), key=lambda shard: shard[0]):
        rows, nbytes = sum(size for _, size in run), row_bytes(qtype, in_features)
        parts.append(BlockPart(qtype, first_row, rows, offset, nbytes))
        first_row, offset = first_row + rows, offset + rows * nbytes
    return tuple(parts)


class GGUFLinearMethod:
    """One layer's GGUF weight; ``dequantize``: always dequantise it at load; ``activations``: how
    its input meets the blocks (:func:`~tokenmill_quant_gguf.kernels.gguf_linear`)."""

    def __init__(self, dequantize: bool = False, activations: Activations = "auto") -> None:
        self.dequantize = dequantize
        self.activations: Activations = activations
        self.parts: tuple[BlockPart, ...] = ()  # set when the layer keeps its blocks
        self._types: dict[int, GGMLQuantizationType] = {}
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def qtypes(self) -> tuple[GGMLQuantizationType, ...]:
        """The block type of each part (one for a layer of one type); empty for a float layer."""
        return tuple(part.qtype for part in self.parts)

    @property
    def qtype(self) -> GGMLQuantizationType | None:
        """The layer's block type when it has one; None for a float layer or a mix of types."""
        return self.parts[0].qtype if len(self.parts) == 1 else None

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
        types = [self._types[shard] for shard in shards]
        rows = [self._rows[shard] for shard in shards]
        del linear.qweight_type, linear.qweight
        if not self.dequantize and all(qtype in KEPT_QUANTIZED for qtype in types):
            self.parts = block_parts(types, linear.output_partition_sizes, linear.in_features)
            if len(self.parts) == 1:  # [out, bytes per row]
                linear.register_buffer("qweight", torch.cat(rows) if len(rows) > 1 else rows[0])
            else:  # rows of different widths: their bytes end to end, each part a view
                linear.register_buffer("qweight", torch.cat([part.reshape(-1) for part in rows]))
        else:
            weight = torch.cat([dequantize_rows(part, qtype, linear.in_features)
                                for qtype, part in zip(types, rows, strict=True)])
            weight = linear.add_parameter("weight", weight.to(linear.params_dtype), output_dim=0, input_dim=1)
            linear.register_buffer("prepared_weight", layer_ops(weight.device).prepare_linear_weight(weight),
                                   persistent=False)
            reason = "as asked" if self.dequantize else "no kernel keeps this type quantized"
            logger.debug("%s: GGUF %s weights dequantised at load, %s", linear.prefix,
                         "/".join(sorted({t.name for t in types})), reason)
        self._types, self._rows = {}, {}

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        bias = cast(torch.Tensor | None, layer.bias)
        if not self.parts:
            return layer_ops(x.device).linear(x, cast(torch.Tensor, layer.weight), bias,
                                              cast(torch.Tensor | None, layer.prepared_weight))
        qweight = cast(torch.Tensor, layer.qweight)
        if len(self.parts) == 1:
            return gguf_linear(x, qweight, self.parts[0].qtype, layer.in_features, bias, self.activations)
        return torch.cat([gguf_linear(x, part.rows_of(qweight), part.qtype, layer.in_features,
                                      None if bias is None else bias.narrow(0, part.first_row, part.rows), self.activations)
                          for part in self.parts], dim=-1)


def _input_blocks(layer: Linear, loaded: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A row-parallel rank's slice of the input: its ``in_features`` values, as whole blocks."""
    size, nbytes = block_geometry(qtype)
    if layer.in_features % size:
        raise ValueError(f"{layer.prefix}: {layer.in_features} input features per rank split {qtype.name} blocks "
                         f"of {size} values; run with a tensor-parallel size that keeps blocks whole")
    width = layer.in_features // size * nbytes
    return loaded.narrow(1, layer.output_loader.rank * width, width)

