"""The AWQ (GEMM layout) linear method.

Parameters, for ``K`` inputs, ``N`` outputs and ``G = K / group_size`` groups:
``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[G, N / 8]``, each word
holding eight 4-bit values of consecutive output columns in AWQ's interleaved
order (nibble ``i`` of the word for columns ``8c .. 8c + 7`` is column
``8c + AWQ_ORDER[i]``), and ``scales`` ``[G, N]`` (float16 on disk, kept float32).
Both stay packed; once loaded their words are rewritten in natural order (nibble
``i`` is column ``8c + i``, the GPTQ plugin's column packing), so the forward pass is
the GPTQ plugin's grouped dequantise-then-matmul with ``g = k // group_size``.

A merged layer's shards (q/k/v, gate/up) are loaded into their own words, so each
shard's outputs must be a multiple of 8, and the input a multiple of the group:
a shape that does not divide is refused when the layer is built, never rounded.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn

from tokenmill.layers import (
    CpuPackedInt,
    Linear,
    OutputShardLoader,
    cpu_packed_int_linear,
    cpu_packed_int_weights,
    dequantize_grouped,
    dequantized_linear,
    pack_columns,
    unpack_columns,
)

BITS = 4
PER_WORD = 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of a word holds, by nibble
NATURAL_FROM_AWQ = tuple(AWQ_ORDER.index(column) for column in range(PER_WORD))  # the nibble each column is in


def awq_to_natural(packed: torch.Tensor) -> torch.Tensor:
    """Words in AWQ's interleaved order -> the same values packed in natural column order."""
    values = unpack_columns(packed, BITS).view(packed.shape[0], -1, PER_WORD)[:, :, list(NATURAL_FROM_AWQ)]
    return pack_columns(values.reshape(packed.shape[0], -1), BITS)


class AwqLinearMethod:
    """On a CPU with AVX-512 the shared packed-int kernel (tokenmill.layers.packed_int_cpu, the weights
    repacked once at load), elsewhere the torch path: dequantise, then matmul."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.cpu_weights: CpuPackedInt | None = None  # the CPU kernel's layout, when it runs

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        group = input_size if self.group_size == -1 else self.group_size
        per_rank = " per rank" if layer.parallel == "row" else ""
        if input_size % group:
            raise ValueError(f"{layer.prefix}: {input_size} input features{per_rank} do not divide into AWQ groups "
                             f"of {group}")
        if any(size % PER_WORD for size in output_partition_sizes):
            where = f" (per rank, over {layer.output_loader.world_size} ranks)" if layer.parallel == "column" else ""
            raise ValueError(f"{layer.prefix}: output shards {output_partition_sizes}{where} are not multiples of "
                             f"{PER_WORD} (AWQ packs {PER_WORD} output columns to a word)")
        words, groups = sum(output_partition_sizes) // PER_WORD, input_size // group
        # Row-parallel: each rank holds its inputs' rows of qweight and its whole groups of qzeros
        # and scales; one group over all inputs (group_size -1) is the same on every rank.
        shards, group_dim = layer.output_loader, 0 if self.group_size != -1 else None
        layer.add_parameter("qweight", torch.zeros(input_size, words, dtype=torch.int32), output_dim=1, input_dim=0,
                            weight_loader=functools.partial(_load_packed, shards, "qweight"))
        layer.add_parameter("qzeros", torch.zeros(groups, words, dtype=torch.int32), output_dim=1,
                            input_dim=group_dim, weight_loader=functools.partial(_load_packed, shards, "qzeros"))
        layer.add_parameter("scales", torch.zeros(groups, sum(output_partition_sizes), dtype=torch.float32),
                            output_dim=1, input_dim=group_dim,
                            weight_loader=functools.partial(_load_scales, shards, group))
        layer.register_buffer("g_idx", (torch.arange(input_size) // group).to(torch.int32), persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("qweight", "qzeros"):
            param = cast(torch.Tensor, getattr(layer, name))
            param.data = awq_to_natural(param.data)
        qweight = cast(torch.Tensor, layer.qweight)
        if qweight.device.type == "cpu":
            self.cpu_weights = cpu_packed_int_weights(
                unpack_columns(qweight, BITS), unpack_columns(cast(torch.Tensor, layer.qzeros), BITS),
                cast(torch.Tensor, layer.scales), cast(torch.Tensor, layer.g_idx), BITS,
                cast(torch.Tensor | None, layer.bias), "awq")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_weights is not None:
            return cpu_packed_int_linear(x, self.cpu_weights)
        weight = dequantize_grouped(unpack_columns(cast(torch.Tensor, layer.qweight), BITS),
                                    unpack_columns(cast(torch.Tensor, layer.qzeros), BITS),
                                    cast(torch.Tensor, layer.scales), cast(torch.Tensor, layer.g_idx), x.dtype)
        out = dequantized_linear(x.reshape(-1, x.shape[-1]), weight, cast(torch.Tensor | None, layer.bias))
        return out.reshape(*x.shape[:-1], weight.shape[1])


def _load_packed(shards: OutputShardLoader, name: str, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: int | None = None) -> None:
    """A packed tensor into its shard's words (``[rows, outputs / 8]``). Under tensor parallelism
    this rank's words are cut out first: whole words, as each rank's outputs are a multiple of 8
    (checked when the layer was built), so the interleave inside a word is untouched."""
    if loaded.dtype != torch.int32:
        raise ValueError(f"{shards.prefix}.{name}: expected packed int32, the checkpoint has {loaded.dtype}")
    loaded = shards.rank_slice(param, loaded, shard_id)
    offset, size = shards.shard_slice(shard_id) if shard_id is not None else (0, param.shape[1] * PER_WORD)
    target = param.data.narrow(1, offset // PER_WORD, size // PER_WORD)
    if target.shape != loaded.shape:
        where = f"shard {shard_id} of " if shard_id is not None else ""
        raise ValueError(f"{shards.prefix}.{name}: shape {tuple(loaded.shape)} for {where}a layer of "
                         f"{param.shape[0]} rows and {size} outputs; expected {tuple(target.shape)}")
    target.copy_(loaded)


def _load_scales(shards: OutputShardLoader, group: int, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: int | None = None) -> None:
    split = shards.input_split and getattr(param, "input_dim", None) is not None
    groups = param.shape[0] * (shards.world_size if split else 1)
    if loaded.dim() != 2 or loaded.shape[0] != groups:
        raise ValueError(f"{shards.prefix}.scales: shape {tuple(loaded.shape)}, but groups of {group} input "
                         f"features make {groups} groups (rows)")
    shards(param, loaded.float(), shard_id)
