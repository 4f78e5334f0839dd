"""Pack-quantized int weights with float activations (W4A16, W8A16), compressed-tensors' layout.

Parameters, for ``K`` inputs, ``N`` outputs, ``p = 32 / bits`` and ``G`` groups
(``ceil(K / group_size)``, or 1 per channel):

* ``weight_packed``: int32 ``[N, ceil(K / p)]``, each row's values packed low bits
  first, offset by ``2**(bits-1)`` (``pack_to_int32``: the row padded to whole words);
* ``weight_scale``: ``[N, G]`` (the model's float dtype on disk), kept float32;
* ``weight_zero_point`` (asymmetric only): int32 ``[ceil(N / p), G]``, packed along
  the *output* dimension, the same offset; unpacked at load into ``[N, G]`` so that
  the shards of a merged layer need not start on a word boundary;
* ``weight_shape``: ``[N, K]``, checked against the layer and not kept.

With the offsets, ``W[n, k] = scale[n, g] * (q[n, k] - zero[n, g])`` on the stored
(unsigned) values, a symmetric scheme's zero being ``2**(bits-1)``: the same grouped
dequantisation as GPTQ's (``tokenmill.layers.dequantize_grouped``).
"""

from __future__ import annotations

import functools
import math
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
    unpack_columns,
    unpack_rows,
)


class PackedIntLinearMethod:
    """On a CPU with AVX-512 the shared packed-int kernel (tokenmill.layers.packed_int_cpu, the weights
    repacked once at load), elsewhere the torch path: dequantise, then matmul."""

    def __init__(self, bits: int, group_size: int | None, symmetric: bool) -> None:
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.cpu_weights: CpuPackedInt | None = None  # the CPU kernel's layout, when it runs

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        per_word, outputs = 32 // self.bits, sum(output_partition_sizes)
        group = self.group_size or input_size
        groups = math.ceil(input_size / group)
        if layer.parallel == "row":
            _check_row_split(layer, input_size, per_word, self.group_size)
        shards = layer.output_loader
        # Row-parallel: a rank's inputs are whole words of each row and whole groups (checked
        # above); per-channel scales (one group over all inputs) are the same on every rank.
        group_dim = 1 if self.group_size else None
        layer.add_parameter("weight_packed", torch.zeros(outputs, math.ceil(input_size / per_word), dtype=torch.int32),
                            output_dim=0, input_dim=1, weight_loader=functools.partial(_load_packed, shards))
        layer.add_parameter("weight_scale", torch.zeros(outputs, groups, dtype=torch.float32), output_dim=0,
                            input_dim=group_dim, weight_loader=functools.partial(_load_scale, shards, group, input_size))
        layer.add_parameter("weight_shape", torch.zeros(2, dtype=torch.int64),
                            weight_loader=functools.partial(_check_shape, shards, input_size))
        if self.symmetric:
            layer.register_buffer("zeros", torch.full((groups, outputs), 1 << (self.bits - 1), dtype=torch.int32),
                                  persistent=False)
        else:
            layer.add_parameter("weight_zero_point", torch.full((outputs, groups), -1, dtype=torch.int32),
                                output_dim=0, input_dim=group_dim, weight_loader=functools.partial(_load_zero_point, shards, self.bits))
        layer.register_buffer("g_idx", (torch.arange(input_size) // group).to(torch.int32), persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.symmetric:
            zero_point = cast(torch.Tensor, layer.weight_zero_point)
            if (zero_point < 0).any():
                raise ValueError(f"{cast(Linear, layer).prefix}: asymmetric scheme but no weight_zero_point for "
                                 "some output shard")
            layer.register_buffer("zeros", zero_point.t().contiguous(), persistent=False)
        packed = cast(torch.Tensor, layer.weight_packed)
        if packed.device.type == "cpu":
            k = cast(torch.Tensor, layer.g_idx).shape[0]
            self.cpu_weights = cpu_packed_int_weights(
                unpack_columns(packed, self.bits)[:, :k].t(), cast(torch.Tensor, layer.zeros),
                cast(torch.Tensor, layer.weight_scale).t(), cast(torch.Tensor, layer.g_idx), self.bits,
                cast(torch.Tensor | None, layer.bias), "compressed-tensors pack-quantized")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_weights is not None:
            return cpu_packed_int_linear(x, self.cpu_weights)
        k = x.shape[-1]
        q = unpack_columns(cast(torch.Tensor, layer.weight_packed), self.bits)[:, :k]
        weight = dequantize_grouped(q.t(), cast(torch.Tensor, layer.zeros), cast(torch.Tensor, layer.weight_scale).t(),
                                    cast(torch.Tensor, layer.g_idx), x.dtype)
        out = dequantized_linear(x.reshape(-1, k), weight, cast(torch.Tensor | None, layer.bias))
        return out.reshape(*x.shape[:-1], weight.shape[1])


def _check_row_split(layer: Linear, input_size: int, per_word: int, group_size: int | None) -> None:
    """A row-parallel rank's inputs must be whole int32 words of every row (the last word of a
    row is padded, so only the last rank could hold a partial one) and whole groups."""
    if input_size % per_word:
        raise ValueError(f"{layer.prefix}: {input_size} input features per rank over "
                         f"{layer.output_loader.world_size} tensor-parallel ranks are not a multiple of {per_word} "
                         f"(values to an int32 word of weight_packed)")
    if group_size and input_size % group_size:
        raise ValueError(f"{layer.prefix}: {input_size} input features per rank over "
                         f"{layer.output_loader.world_size} tensor-parallel ranks do not hold whole groups of "
                         f"{group_size}")


def _rows(shards: OutputShardLoader, shard_id: int | None) -> int:
    """The checkpoint's output rows for shard ``shard_id`` (the whole layer's, before the rank's
    slice of a column-parallel layer)."""
    if shard_id is None:
        return sum(shards.partition_sizes) * (shards.shard_parts[0] if shards.shard_parts else 1)
    return shards.shard_slice(shard_id)[1] * (shards.shard_parts[shard_id] if shards.shard_parts else 1)


def _full(shards: OutputShardLoader, param: nn.Parameter, dim: int, size: int) -> int:
    """Size ``size`` of this rank's ``param`` along ``dim`` as the whole layer has it."""
    split = shards.input_split and getattr(param, "input_dim", None) == dim
    return size * (shards.world_size if split else 1)


def _load_packed(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: int | None = None) -> None:
    if loaded.dtype != torch.int32:
        raise ValueError(f"{shards.prefix}.weight_packed: expected packed int32, the checkpoint has {loaded.dtype}")
    shards(param, loaded, shard_id)


def _load_scale(shards: OutputShardLoader, group: int, input_size: int, param: nn.Parameter, loaded: torch.Tensor,
                shard_id: int | None = None) -> None:
    groups = _full(shards, param, 1, param.shape[1])
    if loaded.dim() != 2 or loaded.shape[1] != groups:
        inputs = input_size * (shards.world_size if shards.input_split else 1)
        raise ValueError(f"{shards.prefix}.weight_scale: shape {tuple(loaded.shape)}, but groups of {group} over "
                         f"{inputs} input features make {groups} groups (columns)")
    shards(param, loaded.float(), shard_id)


def _load_zero_point(shards: OutputShardLoader, bits: int, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: int | None = None) -> None:
    if loaded.dtype != torch.int32:
        raise ValueError(f"{shards.prefix}.weight_zero_point: expected packed int32, the checkpoint has {loaded.dtype}")
    shards(param, unpack_rows(loaded, bits)[: _rows(shards, shard_id)], shard_id)


def _check_shape(shards: OutputShardLoader, input_size: int, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: int | None = None) -> None:
    expected = [_rows(shards, shard_id), input_size * (shards.world_size if shards.input_split else 1)]
    if loaded.tolist() != expected:
        where = f"shard {shard_id} of " if shard_id is not None else ""
        raise ValueError(f"{shards.prefix}.weight_shape: the checkpoint's weight is {loaded.tolist()}, {where}the "
                         f"layer's is {expected}")
    param.data.copy_(loaded)
