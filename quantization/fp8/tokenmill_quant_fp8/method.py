"""FP8 linear methods: serialized per-tensor / per-channel, block-wise, and online.

Parameters (the checkpoint's names under each layer's prefix):

* ``weight``: float8_e4m3fn ``[out, in]``.
* ``weight_scale``: float32, kept as one scale per output channel ``[out]``. A
  checkpoint stores a single scale per tensor (vLLM's per-tensor layout, one per
  q/k/v or gate/up shard) or one per channel (``[out]`` or ``[out, 1]``). Each
  shard's per-tensor scale is *kept*, repeated over that shard's rows, rather than
  the merged layer being requantized to the largest one as vLLM does: with per-token
  activations the matmul takes per-channel weight scales anyway, and keeping them
  loses nothing to a second rounding.
* ``input_scale`` (``activation_scheme: "static"``): one float32 per shard; the
  shards of a merged layer multiply the same input, so the largest is used (none of
  them clips).
* block-wise: ``weight_scale_inv`` ``[ceil(out / rows), ceil(in / cols)]``, one scale
  per weight block; each shard of a merged layer must be a whole number of blocks.
"""

from __future__ import annotations

import functools
import math
from typing import cast

import torch
from torch import nn

from tokenmill.layers import Linear, OutputShardLoader, add_float_weight, quantize_loaded_weight
from tokenmill_quant_fp8.cpu_kernel import (
    choose_cpu_kernel,
    fp8_cpu_linear,
    kernel_bias,
    kernel_scales_per_block,
    kernel_scales_per_channel,
)
from tokenmill_quant_fp8.kernels import (
    FP8_DTYPE,
    block_scales_per_row,
    choose_fp8_gemm,
    fp8_block_linear_reference,
    fp8_block_linear_scaled_mm,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    quantize_fp8,
    quantize_per_token,
    quantize_weight_per_channel,
)


class Fp8LinearMethod:
    """A float8_e4m3fn weight with per-channel scales; activations per token (or by
    the checkpoint's static scale), multiplied by ``torch._scaled_mm`` where it runs. On a
    CPU the weight-only kernel (:mod:`tokenmill_quant_fp8.cpu_kernel`) runs where it builds:
    the weight widened in registers, the activations not quantized."""

    def __init__(self, static_input: bool = False) -> None:
        self.static_input = static_input
        self.gemm = "reference"  # chosen once the weights are on their device

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        output_size = sum(output_partition_sizes)
        shards = layer.output_loader
        layer.add_parameter("weight", torch.empty(output_size, input_size, dtype=FP8_DTYPE), output_dim=0,
                            weight_loader=functools.partial(_load_fp8_weight, shards))
        self.create_scales(layer, output_partition_sizes)

    def create_scales(self, layer: Linear, output_partition_sizes: list[int]) -> None:
        shards = layer.output_loader
        layer.add_parameter("weight_scale", torch.empty(sum(output_partition_sizes), dtype=torch.float32),
                            output_dim=0, weight_loader=functools.partial(_load_weight_scale, shards))
        if self.static_input:
            layer.add_parameter("input_scale", torch.full((len(output_partition_sizes),), math.nan),
                                weight_loader=functools.partial(_load_input_scale, shards))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight)
        if self.static_input:
            input_scale = cast(torch.Tensor, layer.input_scale)
            if input_scale.isnan().any():
                missing = [i for i, value in enumerate(input_scale.tolist()) if math.isnan(value)]
                raise ValueError(f"{cast(Linear, layer).prefix}: activation_scheme 'static' but the checkpoint "
                                 f"has no input_scale for output shard(s) {missing}")
            layer.register_buffer("static_input_scale", input_scale.max().reshape(1, 1), persistent=False)
        if weight.device.type == "cpu" and choose_cpu_kernel(weight, "fp8"):
            self.gemm = "cpu_kernel"
            _register_kernel_operands(layer, kernel_scales_per_channel(cast(torch.Tensor, layer.weight_scale)))
            return
        self.gemm = choose_fp8_gemm(weight.device, weight.shape[1], weight.shape[0])

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        weight, weight_scale = cast(torch.Tensor, layer.weight), cast(torch.Tensor, layer.weight_scale)
        rows = x.reshape(-1, x.shape[-1])
        if self.gemm == "cpu_kernel":
            return _kernel_apply(layer, rows, weight.shape[1]).reshape(*x.shape[:-1], weight.shape[0])
        if self.static_input:
            # _scaled_mm takes row-wise scales only alongside row-wise weight scales: one per row
            x_scale = cast(torch.Tensor, layer.static_input_scale).expand(rows.shape[0], 1).contiguous()
            xq = quantize_fp8(rows, x_scale)
        else:
            xq, x_scale = quantize_per_token(rows)
        gemm = fp8_linear_scaled_mm if self.gemm == "scaled_mm" else fp8_linear_reference
        out = gemm(xq, x_scale, weight, weight_scale, cast(torch.Tensor | None, layer.bias), x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])


class Fp8OnlineLinearMethod(Fp8LinearMethod):
    """``quantization="fp8"`` on a float checkpoint: the float weight loads as usual,
    then is quantized per output channel (and the float copy dropped)."""

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        add_float_weight(layer, input_size, output_partition_sizes, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        quantize_loaded_weight(cast(Linear, layer), quantize_weight_per_channel)
        super().process_weights_after_loading(layer)


class Fp8BlockLinearMethod:
    """Block-wise FP8 (DeepSeek-V3, Qwen3-FP8): one scale per ``block`` of the weight,
    activations quantized per token and per ``block[1]`` columns; one row-wise
    ``_scaled_mm`` per column group where it runs, else the torch reference."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block
        self.gemm = "reference"  # chosen once the weights are on their device

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        rows, cols = self.block
        if len(output_partition_sizes) > 1 and any(size % rows for size in output_partition_sizes):
            raise ValueError(f"{layer.prefix}: output shards {output_partition_sizes} are not whole blocks of "
                             f"{rows} rows (weight_block_size {list(self.block)})")
        shards = layer.output_loader
        layer.add_parameter("weight", torch.empty(sum(output_partition_sizes), input_size, dtype=FP8_DTYPE),
                            output_dim=0, weight_loader=functools.partial(_load_fp8_weight, shards))
        scales = torch.empty(-(-sum(output_partition_sizes) // rows), -(-input_size // cols), dtype=torch.float32)
        layer.add_parameter("weight_scale_inv", scales, output_dim=0,
                            weight_loader=functools.partial(_load_block_scales, shards, self.block))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight)
        if weight.device.type == "cpu" and choose_cpu_kernel(weight, "block-wise fp8"):
            self.gemm = "cpu_kernel"
            scales = kernel_scales_per_block(cast(torch.Tensor, layer.weight_scale_inv), self.block[0], weight.shape[0])
            _register_kernel_operands(layer, scales)
            return
        self.gemm = choose_fp8_gemm(weight.device, weight.shape[1], weight.shape[0], block_cols=self.block[1])
        if self.gemm == "scaled_mm":
            row_scales = block_scales_per_row(cast(torch.Tensor, layer.weight_scale_inv), self.block[0], weight.shape[0])
            layer.register_buffer("block_row_scales", row_scales, persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        weight, bias = cast(torch.Tensor, layer.weight), cast(torch.Tensor | None, layer.bias)
        rows = x.reshape(-1, x.shape[-1])
        if self.gemm == "cpu_kernel":
            out = _kernel_apply(layer, rows, self.block[1])
        elif self.gemm == "scaled_mm":
            out = fp8_block_linear_scaled_mm(rows, weight, cast(torch.Tensor, layer.block_row_scales), self.block, bias)
        else:
            out = fp8_block_linear_reference(rows, weight, cast(torch.Tensor, layer.weight_scale_inv), self.block, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])


def _register_kernel_operands(layer: nn.Module, scales: torch.Tensor) -> None:
    """The CPU kernel's scales ``[N, G]`` and float32 bias, made once at load (not parameters: the
    checkpoint's own stay as they are)."""
    layer.register_buffer("kernel_scales", scales, persistent=False)
    layer.register_buffer("kernel_bias", kernel_bias(cast(torch.Tensor | None, layer.bias)), persistent=False)


def _kernel_apply(layer: nn.Module, rows: torch.Tensor, group_size: int) -> torch.Tensor:
    return fp8_cpu_linear(rows, cast(torch.Tensor, layer.weight), cast(torch.Tensor, layer.kernel_scales), group_size,
                          cast(torch.Tensor | None, layer.kernel_bias))


def _shard_rows(shards: OutputShardLoader, shard_id: int | None) -> tuple[int, int]:
    """``(offset, rows)`` of shard ``shard_id`` (the whole layer for None)."""
    return shards.shard_slice(shard_id) if shard_id is not None else (0, sum(shards.partition_sizes))


def _load_fp8_weight(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: int | None = None) -> None:
    if loaded.dtype != FP8_DTYPE:
        raise ValueError(f"{shards.prefix}.weight: expected float8_e4m3fn, the checkpoint has {loaded.dtype} "
                         "(a float layer belongs in ignored_layers)")
    shards(param, loaded, shard_id)


def _load_weight_scale(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                       shard_id: int | None = None) -> None:
    """A single scale (per tensor: repeated over the shard's rows) or one per row."""
    _, rows = _shard_rows(shards, shard_id)
    per_channel = loaded.numel() == rows and (loaded.dim() == 1 or loaded.shape[1:] == (1,))
    if loaded.numel() == 1:
        loaded = loaded.reshape(1).expand(rows)
    elif not per_channel:
        where = f"shard {shard_id} of " if shard_id is not None else ""
        raise ValueError(f"{shards.prefix}.weight_scale: a tensor of shape {tuple(loaded.shape)} for {where}a layer "
                         f"of {rows} output rows; expected one scale (per tensor) or {rows} (per channel)")
    shards(param, loaded.reshape(rows).float(), shard_id)


def _load_input_scale(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"{shards.prefix}.input_scale: expected one scale per tensor, the checkpoint has shape "
                         f"{tuple(loaded.shape)}")
    if shard_id is not None:
        shards.shard_slice(shard_id)  # checks the shard exists
    param.data[shard_id or 0] = loaded.reshape(()).float()


def _load_block_scales(shards: OutputShardLoader, block: tuple[int, int], param: nn.Parameter, loaded: torch.Tensor,
                       shard_id: int | None = None) -> None:
    offset, rows = _shard_rows(shards, shard_id)
    expected = (-(-rows // block[0]), param.shape[1])
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{shards.prefix}.weight_scale_inv: shape {tuple(loaded.shape)}, expected {expected} "
                         f"(one scale per {block[0]}x{block[1]} block of a {rows}-row weight)")
    param.data[offset // block[0]: offset // block[0] + expected[0]].copy_(loaded.float())
