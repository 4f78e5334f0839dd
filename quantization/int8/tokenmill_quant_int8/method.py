"""INT8 W8A8 linear methods: a checkpoint's int8 weights, or a float checkpoint's quantized at load.

Parameters (compressed-tensors' names under each layer's prefix): ``weight``, int8
``[out, in]``, and ``weight_scale``, one float32 per output channel (stored
``[out, 1]``; ``[out]`` and a single per-tensor scale are taken too, the latter
repeated over the rows). The scales are per channel, so a merged layer's shards
(q/k/v, gate/up) each keep their own rows of both: nothing is requantized.

A static activation scheme (:mod:`tokenmill_quant_int8.activations`) adds
``input_scale`` (and, asymmetric, ``input_zero_point``), one per tensor: a merged
layer loads one per shard and, its shards sharing one input, multiplies with one
(:func:`~tokenmill_quant_int8.activations.merge_static_shards`). An asymmetric scheme
keeps the int8 weight's row sums (``weight_row_sum``) for the zero-point correction.

The default scheme (dynamic per-token, symmetric) runs on a CPU with AVX-512 VNNI or AVX2 as
one call of the plugin's C++ kernel (:func:`~tokenmill_quant_int8.kernels.w8a8_linear_packed_cpu`,
which needs the row sums too), elsewhere as torch ops; the two give the same bits. There the
layer's ``weight`` is, once loaded, the kernel's panels (the same bytes in the order the kernel
reads them, packed once) rather than the row-major int8 matrix.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn

from tokenmill.layers import Linear, OutputShardLoader, add_float_weight, quantize_loaded_weight
from tokenmill_quant_int8.activations import ActivationScheme, merge_static_shards, quantize_input
from tokenmill_quant_int8.kernels import (
    chosen_path,
    cpu_kernel_runs,
    int8_matmul,
    quantize_weight_per_channel,
    scale_output,
    w8a8_linear_packed_cpu,
    w8a8_pack_panels_cpu,
)

STATIC_INPUTS = ("input_scale", "input_zero_point")
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the activations the CPU kernel reads


class Int8W8A8LinearMethod:
    """int8 weights per channel, activations as ``activations`` says (by default dynamic per
    token, symmetric), the product in int32."""

    def __init__(self, activations: ActivationScheme | None = None) -> None:
        self.activations = activations or ActivationScheme()
        self.fused_cpu = False  # the CPU kernel takes the layer: chosen once the weights are loaded

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        shards = layer.output_loader
        layer.add_parameter("weight", torch.empty(sum(output_partition_sizes), input_size, dtype=torch.int8),
                            output_dim=0, input_dim=1, weight_loader=functools.partial(_load_int8_weight, shards))
        self.create_scales(layer, output_partition_sizes)
        if self.activations.static:
            names = STATIC_INPUTS if not self.activations.symmetric else STATIC_INPUTS[:1]
            for name in names:  # one per shard, NaN until loaded
                layer.add_parameter(name, torch.full((len(output_partition_sizes),), float("nan")),
                                    weight_loader=functools.partial(_load_per_tensor, shards, name))

    def create_scales(self, layer: Linear, output_partition_sizes: list[int]) -> None:
        layer.add_parameter("weight_scale", torch.empty(sum(output_partition_sizes), dtype=torch.float32),
                            output_dim=0, weight_loader=functools.partial(_load_weight_scale, layer.output_loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        linear = cast(Linear, layer)
        if self.activations.static:
            loaded = {name: cast(torch.Tensor, getattr(linear, name)).data for name in STATIC_INPUTS
                      if hasattr(linear, name)}
            for name, values in loaded.items():
                if bool(values.isnan().any()):
                    shards = [i for i, value in enumerate(values.tolist()) if value != value]
                    raise ValueError(f"{linear.prefix}: the checkpoint has no {name} for shards {shards} (its "
                                     f"scheme is {self.activations.describe()} activations)")
                delattr(linear, name)
            scale, zero = merge_static_shards(loaded["input_scale"], loaded.get("input_zero_point"))
            linear.register_buffer("input_scale", scale)
            linear.register_buffer("input_zero_point", None if zero is None else zero.to(torch.int32))
        weight = cast(torch.Tensor, linear.weight)
        self.fused_cpu = self.activations == ActivationScheme() and weight.device.type == "cpu" and cpu_kernel_runs()
        if self.fused_cpu:
            chosen_path(weight.device, "the CPU kernel (per-token quantization, product and scaling in one call)")
            # The kernel adds a float32 bias: converted once here, not in every call (where a step
            # graph's capture would also refuse the conversion and run the step eagerly).
            bias = cast(torch.Tensor | None, linear.bias)
            linear.register_buffer("kernel_bias", None if bias is None else bias.float().contiguous(), persistent=False)
        if not self.activations.symmetric or self.fused_cpu:
            linear.register_buffer("weight_row_sum", weight.sum(dim=1, dtype=torch.int32), persistent=False)
        if self.fused_cpu:
            # the kernel's panels replace the row-major weight (one copy of the weight's bytes kept)
            weight.data = w8a8_pack_panels_cpu(weight.data)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        weight = cast(torch.Tensor, layer.weight)
        if self.fused_cpu:  # weight: the kernel's panels
            weight_scale = cast(torch.Tensor, layer.weight_scale)
            if x.device.type != "cpu" or x.dtype not in FUSED_DTYPES:
                raise TypeError(f"{cast(Linear, layer).prefix}: the int8 CPU kernel holds this layer's weight and "
                                f"reads {', '.join(map(str, FUSED_DTYPES))} CPU activations, not {x.dtype} on {x.device}")
            out = w8a8_linear_packed_cpu(x.reshape(-1, x.shape[-1]), weight, cast(Linear, layer).in_features,
                                         weight_scale, cast(torch.Tensor, layer.weight_row_sum),
                                         cast(torch.Tensor | None, layer.kernel_bias))
            return out.reshape(*x.shape[:-1], weight_scale.shape[0])
        static = self.activations.static
        xq = quantize_input(x.reshape(-1, x.shape[-1]), self.activations,
                            cast(torch.Tensor, layer.input_scale) if static else None,
                            cast(torch.Tensor | None, layer.input_zero_point) if static else None)
        acc = int8_matmul(xq.q, weight)
        if xq.zero is not None:  # x = scale * (q - zero): take zero * rowsum(W) back out, exactly in int32
            acc = acc - xq.zero * cast(torch.Tensor, layer.weight_row_sum)
        out = scale_output(acc, xq.scale, cast(torch.Tensor, layer.weight_scale),
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
        super().process_weights_after_loading(layer)


def _load_int8_weight(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
    if loaded.dtype != torch.int8:
        raise ValueError(f"{shards.prefix}.weight: expected an int8 tensor, the checkpoint has {loaded.dtype} "
                         "(a float layer belongs in the config's ignore list)")
    shards(param, loaded, shard_id)


def _load_weight_scale(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                       shard_id: int | None = None) -> None:
    """One scale per output row (``[rows]`` or ``[rows, 1]``), or one for the tensor; ``rows``
    counts the checkpoint's (all ranks'), the loader then takes this rank's."""
    rows = shards.shard_slice(shard_id)[1] if shard_id is not None else sum(shards.partition_sizes)
    if shards.shard_parts:  # column-parallel: this rank holds one part of the shard's rows
        rows *= shards.shard_parts[shard_id or 0]
    if loaded.numel() == 1:
        loaded = loaded.reshape(1).expand(rows)
    elif not (loaded.numel() == rows and (loaded.dim() == 1 or loaded.shape[1:] == (1,))):
        where = f"shard {shard_id} of " if shard_id is not None else ""
        raise ValueError(f"{shards.prefix}.weight_scale: a tensor of shape {tuple(loaded.shape)} for {where}a layer "
                         f"of {rows} output rows; expected [{rows}, 1] (per channel) or one scale (per tensor)")
    shards(param, loaded.reshape(rows).float(), shard_id)


def _load_per_tensor(shards: OutputShardLoader, name: str, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: int | None = None) -> None:
    """A per-tensor ``input_scale`` / ``input_zero_point`` (one value) into its shard's slot
    (every rank holds them whole: they describe the input, not a slice of the output)."""
    if loaded.numel() != 1:
        raise ValueError(f"{shards.prefix}.{name}: a tensor of shape {tuple(loaded.shape)}; the static activation "
                         "scheme is per tensor (one value)")
    index = 0 if shard_id is None else shard_id
    if not 0 <= index < param.shape[0]:
        raise ValueError(f"{shards.prefix} has {param.shape[0]} output shards, not a shard {shard_id}")
    param.data[index] = loaded.reshape(()).float()
