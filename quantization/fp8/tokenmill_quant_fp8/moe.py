"""FP8 experts: ``quantization="fp8"`` on a float MoE checkpoint quantizes every expert per
output channel (:class:`tokenmill.layers.OnlineQuantizedMoEMethod`, with this plugin's
quantizer) and multiplies as the FP8 linear layers do: activations per token, row-wise
``torch._scaled_mm`` where it runs, else the torch reference."""

from __future__ import annotations

import torch

from tokenmill.layers import OnlineQuantizedMoEMethod
from tokenmill_quant_fp8.kernels import (
    choose_fp8_gemm,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    quantize_per_token,
    quantize_weight_per_channel,
)


def fp8_expert_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] by one expert's float8 ``weight`` [N, K] with per-row ``weight_scale`` [N]."""
    xq, x_scale = quantize_per_token(x)
    scaled_mm = choose_fp8_gemm(x.device, weight.shape[1], weight.shape[0]) == "scaled_mm"
    gemm = fp8_linear_scaled_mm if scaled_mm else fp8_linear_reference
    return gemm(xq, x_scale, weight, weight_scale, None, x.dtype)


class Fp8OnlineMoEMethod(OnlineQuantizedMoEMethod):
    def __init__(self) -> None:
        super().__init__(quantize_weight_per_channel, fp8_expert_matmul)
