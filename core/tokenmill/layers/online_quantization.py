"""What every online quantization method (``quantization="fp8"``, ``"int8"`` on a float
checkpoint) does the same way: load the float weight as an unquantized layer would, then replace
it, once loaded, by its quantized form per output channel and a ``weight_scale`` (the float copy
is dropped). The method supplies only its quantizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from tokenmill.layers.linear import Linear

WeightQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # weight -> (qweight, per-row scale)


def add_float_weight(layer: Linear, input_size: int, output_partition_sizes: list[int],
                     params_dtype: torch.dtype) -> None:
    """The float ``weight`` the checkpoint loads into, before it is quantized (split as a float
    layer's is under tensor parallelism: by output rows, or by input columns when row-parallel)."""
    layer.add_parameter("weight", torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype),
                        output_dim=0, input_dim=1)


def quantize_loaded_weight(layer: Linear, quantize: WeightQuantizer) -> None:
    """Replace the loaded float ``weight`` by ``quantize``'s weight and its ``weight_scale``."""
    qweight, scale = quantize(cast(torch.Tensor, layer.weight).data)
    layer.add_parameter("weight", qweight, output_dim=0)
    layer.add_parameter("weight_scale", scale, output_dim=0)
