"""Weight-only int8 with one scale per output channel, in torch.

Each quantized layer holds ``qweight`` (int8, ``[out, in]``) and ``scales``
(float32, ``[out]``); it computes ``(x @ qweight.T) * scales + bias``, which is
``x @ W.T + bias`` for the dequantised ``W = qweight * scales[:, None]`` up to
rounding. A merged layer (q/k/v, gate/up) is quantized per projection in the
checkpoint; since the scales are per output channel, shard ``i``'s rows of both
parameters are its own slice of the merged output.

``quantization_config["ignored_layers"]`` lists checkpoint prefixes (a module and
everything under it) that stay float, stored as plain ``weight`` tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, ClassVar, Self, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import Linear, OutputShardLoader, QuantizationConfig


class Int8WeightOnlyConfig(QuantizationConfig):
    name: ClassVar[str] = "example-int8"

    def __init__(self, ignored_layers: Sequence[str] = ()) -> None:
        self.ignored_layers = tuple(ignored_layers)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(config.get("ignored_layers", ()))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Int8WeightOnlyMethod | None:
        if any(prefix == ignored or prefix.startswith(ignored + ".") for ignored in self.ignored_layers):
            return None
        return Int8WeightOnlyMethod()


class Int8WeightOnlyMethod:
    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        output_size = sum(output_partition_sizes)
        shards = layer.output_loader  # the layer's shard layout, not the layer (no reference cycle)
        # input_dim: a row-parallel layer's rank takes its columns (the per-output scales stay whole)
        layer.add_parameter("qweight", torch.empty(output_size, input_size, dtype=torch.int8), output_dim=0,
                            input_dim=1, weight_loader=functools.partial(_load_qweight, shards))
        layer.add_parameter("scales", torch.empty(output_size, dtype=torch.float32), output_dim=0,
                            weight_loader=functools.partial(_load_scales, shards))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        qweight, scales = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        out = F.linear(x, qweight.to(x.dtype)) * scales.to(x.dtype)
        bias = cast(torch.Tensor | None, layer.bias)
        return out if bias is None else out + bias


def _load_qweight(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                  shard_id: int | None = None) -> None:
    """An int8 tensor only: a float one means a layer the checkpoint did not quantize."""
    if loaded.dtype != torch.int8:
        raise ValueError(f"{shards.prefix}.qweight: expected an int8 tensor, the checkpoint has {loaded.dtype}")
    shards(param, loaded, shard_id)


def _load_scales(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: int | None = None) -> None:
    """Scales stored as ``[out]`` or ``[out, 1]``, kept in float32."""
    shards(param, loaded.reshape(-1).to(param.dtype), shard_id)
