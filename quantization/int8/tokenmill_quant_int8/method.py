"""INT8 W8A8 linear methods: a checkpoint's int8 weights, or a float checkpoint's quantized at load.

Parameters (compressed-tensors' names under each layer's prefix): ``weight``, int8
``[out, in]``, and ``weight_scale``, one float32 per output channel (stored
``[out, 1]``; ``[out]`` and a single per-tensor scale are taken too, the latter
repeated over the rows). The scales are per channel, so a merged layer's shards
(q/k/v, gate/up) each keep their own rows of both: nothing is requantized.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn

from tokenmill.layers import Linear, OutputShardLoader, add_float_weight, quantize_loaded_weight
from tokenmill_quant_int8.kernels import int8_matmul, quantize_per_token, quantize_weight_per_channel, scale_output


class Int8W8A8LinearMethod:
    """int8 weights per channel, activations per token, the product in int32."""

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        shards = layer.output_loader
        layer.add_parameter("weight", torch.empty(sum(output_partition_sizes), input_size, dtype=torch.int8),
                            output_dim=0, weight_loader=functools.partial(_load_int8_weight, shards))
        self.create_scales(layer, output_partition_sizes)

    def create_scales(self, layer: Linear, output_partition_sizes: list[int]) -> None:
        layer.add_parameter("weight_scale", torch.empty(sum(output_partition_sizes), dtype=torch.float32),
                            output_dim=0, weight_loader=functools.partial(_load_weight_scale, layer.output_loader))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        weight = cast(torch.Tensor, layer.weight)
        xq, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
        out = scale_output(int8_matmul(xq, weight), x_scale, cast(torch.Tensor, layer.weight_scale),
                           cast(torch.Tensor | None, layer.bias), x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])


class Int8OnlineLinearMethod(Int8W8A8LinearMethod):
    """``quantization="int8"`` on a float checkpoint: the float weight loads as usual,
    then is quantized per output channel (and the float copy dropped)."""

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        add_float_weight(layer, input_size, output_partition_sizes, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        quantize_loaded_weight(cast(Linear, layer), quantize_weight_per_channel)


def _load_int8_weight(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
    if loaded.dtype != torch.int8:
        raise ValueError(f"{shards.prefix}.weight: expected an int8 tensor, the checkpoint has {loaded.dtype} "
                         "(a float layer belongs in the config's ignore list)")
    shards(param, loaded, shard_id)


def _load_weight_scale(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                       shard_id: int | None = None) -> None:
    """One scale per output row (``[rows]`` or ``[rows, 1]``), or one for the tensor."""
    rows = shards.shard_slice(shard_id)[1] if shard_id is not None else sum(shards.partition_sizes)
    if loaded.numel() == 1:
        loaded = loaded.reshape(1).expand(rows)
    elif not (loaded.numel() == rows and (loaded.dim() == 1 or loaded.shape[1:] == (1,))):
        where = f"shard {shard_id} of " if shard_id is not None else ""
        raise ValueError(f"{shards.prefix}.weight_scale: a tensor of shape {tuple(loaded.shape)} for {where}a layer "
                         f"of {rows} output rows; expected [{rows}, 1] (per channel) or one scale (per tensor)")
    shards(param, loaded.reshape(rows).float(), shard_id)
