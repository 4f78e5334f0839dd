"""FP8 experts: ``quantization="fp8"`` on a float MoE checkpoint quantizes every expert per
output channel (:class:`tokenmill.layers.OnlineQuantizedMoEMethod`, with this plugin's
quantizer) and multiplies as the FP8 linear layers do: activations per token, row-wise
``torch._scaled_mm`` where it runs, else the torch reference; on a device whose layer ops
have a grouped quantized kernel (CUDA: the Triton fused MoE) all experts run in that instead.
A serialized FP8 checkpoint's experts (a float8 ``weight`` and its ``weight_scale`` per
expert) load into the same layout and run the same way (:class:`Fp8SerializedMoEMethod`)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, cast

import torch

from tokenmill.layers import EXPERT_WEIGHTS, OnlineQuantizedMoEMethod
from tokenmill_quant_fp8.kernels import (
    choose_fp8_gemm,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    quantize_per_token,
    quantize_weight_per_channel,
)

if TYPE_CHECKING:
    from tokenmill.layers import FusedMoE


def fp8_expert_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] by one expert's float8 ``weight`` [N, K] with per-row ``weight_scale`` [N]."""
    xq, x_scale = quantize_per_token(x)
    scaled_mm = choose_fp8_gemm(x.device, weight.shape[1], weight.shape[0]) == "scaled_mm"
    gemm = fp8_linear_scaled_mm if scaled_mm else fp8_linear_reference
    return gemm(xq, x_scale, weight, weight_scale, None, x.dtype)


class Fp8OnlineMoEMethod(OnlineQuantizedMoEMethod):
    def __init__(self) -> None:
        super().__init__(quantize_weight_per_channel, fp8_expert_matmul, grouped=True)


class Fp8SerializedMoEMethod(OnlineQuantizedMoEMethod):
    """A serialized FP8 checkpoint's experts: each expert's float8_e4m3fn ``weight`` and its
    ``weight_scale`` (one per tensor, ``[]``, or per output channel, ``[rows]`` / ``[rows, 1]``)
    as the checkpoint stores them (``experts.N.w1.weight`` / ``experts.N.w1.weight_scale``),
    stacked into the online method's layout (``gate_up_proj`` ``[E, 2I, H]`` with
    ``gate_up_proj_scale`` ``[E, 2I]``, a per-tensor scale repeated over its rows) and run
    as it runs them (activations per token)."""

    def __init__(self) -> None:
        super().__init__(quantize_weight_per_channel, fp8_expert_matmul, grouped=True)

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_rank: int, params_dtype: torch.dtype) -> None:
        inter = intermediate_size_per_rank
        for name, layout, rows, cols, width in (("gate_up_proj", "gate_up", 2 * inter, hidden_size, inter),
                                                ("down_proj", "down", hidden_size, inter, hidden_size)):
            weight = layer.add_parameter(name, torch.empty(num_experts, rows, cols, dtype=torch.float8_e4m3fn),
                                         layout=layout)
            weight.weight_loader = functools.partial(_load_expert_fp8, layer)  # type: ignore[attr-defined]
            scale = layer.add_parameter(f"{name}_weight_scale", torch.full((num_experts, rows), math.nan))
            scale.weight_loader = functools.partial(_load_expert_scale, layer, name, width)  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        for name in EXPERT_WEIGHTS:
            scale = cast(torch.nn.Parameter, getattr(layer, f"{name}_weight_scale"))
            missing = scale.isnan().any(dim=1).nonzero().flatten().tolist()
            if missing:
                expert = layer.placement.expert_at(missing[0])  # (its global id under expert parallelism)
                raise ValueError(f"{layer.prefix}: the checkpoint has no weight_scale for expert {expert}'s "
                                 f"{name} ({len(missing)} expert(s) without one)")
            layer.register_parameter(f"{name}_scale", scale)  # the name the online method's apply reads


def _load_expert_fp8(layer: FusedMoE, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None,
                     expert_id: int | None = None) -> None:
    if loaded.dtype != torch.float8_e4m3fn:
        name = layer.loader.tensor_name(param.expert_layout, shard_id, expert_id)  # type: ignore[attr-defined]
        raise ValueError(f"{name}: expected float8_e4m3fn, the checkpoint has {loaded.dtype} "
                         "(a float MoE layer belongs in ignored_layers)")
    layer.loader(param, loaded, shard_id, expert_id=expert_id)


def _load_expert_scale(layer: FusedMoE, stack: str, width: int, param: torch.nn.Parameter, loaded: torch.Tensor,
                       shard_id: int | None = None, expert_id: int | None = None) -> None:
    """One expert's scale for its gate (shard 0), up (1) or down rows: one value per tensor
    (repeated over the rows) or one per row. Under tensor parallelism a rank holds a slice of
    each expert's gate and up rows (the loader cuts the weight's), so it takes that slice of
    their per-row scales; the down rows (the hidden size) are not split."""
    if expert_id is None:
        raise ValueError(f"{layer.prefix}.{stack}_weight_scale: FP8 expert scales are read per expert "
                         "(experts.N.<projection>.weight_scale)")
    target = param.data[expert_id] if shard_id is None else param.data[expert_id].narrow(0, shard_id * width, width)
    rows = target.shape[0]
    ranks = layer.loader.world_size
    if shard_id is not None and ranks > 1 and loaded.numel() == rows * ranks:
        loaded = loaded.reshape(-1).narrow(0, layer.loader.rank * rows, rows)
    if loaded.numel() == 1:
        loaded = loaded.reshape(1).expand(rows)
    elif loaded.numel() != rows or loaded.dim() > 2 or (loaded.dim() == 2 and loaded.shape[1] != 1):
        name = layer.loader.tensor_name("down" if stack == "down_proj" else "gate_up", shard_id, expert_id)
        raise ValueError(f"{name.removesuffix('.weight')}.weight_scale: a tensor of shape {tuple(loaded.shape)} for "
                         f"{rows} output rows; expected one scale (per tensor) or {rows} (per channel)")
    target.copy_(loaded.reshape(rows).float())
