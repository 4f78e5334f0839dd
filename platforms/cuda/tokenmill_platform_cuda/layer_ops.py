"""The CUDA platform's layer ops: the Triton fused MoE for the experts (float and FP8/INT8),
the torch reference for everything else (cuBLAS runs the linear layers already).

Registered for device type ``cuda`` by the platform when triton imports. The float kernel
takes float32, bfloat16 and float16 experts; other dtypes stay on the reference.
"""

from __future__ import annotations

import torch

from tokenmill.layers import NativeLayerOps

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DOT = (8, 9)  # the first compute capability whose tensor cores multiply float8


class CudaLayerOps(NativeLayerOps):
    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype or not x.numel():
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids)
        from tokenmill_platform_cuda.fused_moe_triton import triton_fused_moe

        return triton_fused_moe(x, w13, w2, topk_weights, topk_ids)

    def quantized_fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                            w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor | None:
        """float8_e4m3fn / int8 experts with row scales, activations quantized per token
        (``tokenmill.layers.QuantizedFusedMoEOps``); None for what the kernel does not take."""
        from tokenmill_platform_cuda.fused_moe_triton import QUANTIZED_WEIGHT_DTYPES, triton_fused_moe_quantized

        if w13.dtype not in QUANTIZED_WEIGHT_DTYPES or w2.dtype != w13.dtype or x.dtype not in KERNEL_DTYPES:
            return None
        if w13.dtype == torch.float8_e4m3fn and x.is_cuda and torch.cuda.get_device_capability(x.device) < FP8_DOT:
            return None  # no float8 tensor-core dot before Ada/Hopper: the method's own path
        if not x.numel():
            return torch.zeros_like(x)
        return triton_fused_moe_quantized(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
