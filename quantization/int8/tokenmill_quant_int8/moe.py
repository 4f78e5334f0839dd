"""INT8 experts: ``quantization="int8"`` on a float MoE checkpoint quantizes every expert
per output channel (:class:`tokenmill.layers.OnlineQuantizedMoEMethod`, with this plugin's
quantizer) and multiplies as the W8A8 linear layers do: activations per token, the product
in int32 (``torch._int_mm`` where it takes the shape); on a device whose layer ops have a
grouped quantized kernel (CUDA: the Triton fused MoE) all experts run in that instead."""

from __future__ import annotations

import torch

from tokenmill.layers import OnlineQuantizedMoEMethod
from tokenmill_quant_int8.kernels import int8_matmul, quantize_per_token, quantize_weight_per_channel, scale_output


def int8_expert_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] by one expert's int8 ``weight`` [N, K] with per-row ``weight_scale`` [N]."""
    xq, x_scale = quantize_per_token(x)
    return scale_output(int8_matmul(xq, weight), x_scale, weight_scale, None, x.dtype)


class Int8OnlineMoEMethod(OnlineQuantizedMoEMethod):
    def __init__(self) -> None:
        super().__init__(quantize_weight_per_channel, int8_expert_matmul, grouped=True)
