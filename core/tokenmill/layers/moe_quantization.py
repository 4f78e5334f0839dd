"""Quantized experts for the FusedMoE quant-method slot, shared by the quantization plugins.

:class:`OnlineQuantizedMoEMethod` is what ``quantization="fp8"`` / ``"int8"`` do to a MoE
layer of a float checkpoint: the stacked float experts load as a float layer's would
(every checkpoint layout :class:`tokenmill.layers.FusedMoE` takes), then each expert's
``gate_up_proj`` ``[2I, H]`` and ``down_proj`` ``[H, I]`` are quantized per output channel
(one scale per row, per expert: ``gate_up_proj_scale`` ``[E, 2I]``, ``down_proj_scale``
``[E, H]``) and the float copies dropped. A plugin supplies its quantizer (the one its
linear layers use) and its quantized matmul (activations rounded per token, its kernel).

Where the device's layer ops have a grouped quantized kernel (:class:`QuantizedFusedMoEOps`:
the CUDA platform's Triton FP8/INT8 fused MoE) and the method says its weights are in the
form that kernel takes (``grouped=True``: float8_e4m3fn or int8, one scale per expert and
row, activations rounded per token), all experts run in it; otherwise the experts run one
at a time, over those that got tokens (the float reference's loop), by ``matmul``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import torch

from tokenmill.layers.ops import layer_ops

if TYPE_CHECKING:
    from tokenmill.layers.moe import FusedMoE

# an expert's float weight [N, K] -> (quantized [N, K], float32 scale per row [N])
ExpertQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (activations [M, K], quantized weight [N, K], its row scales [N]) -> [M, N] in the activations' dtype
QuantizedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@runtime_checkable
class QuantizedFusedMoEOps(Protocol):
    """Layer ops with a grouped kernel for quantized experts."""

    def quantized_fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                            w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor | None:
        """What ``LayerOps.fused_moe`` computes on float8_e4m3fn or int8 experts ``w13`` [E, 2I, H]
        and ``w2`` [E, H, I] with float32 scales per expert and row (``[E, 2I]``, ``[E, H]``),
        the activations quantized per token to the weights' type; None where the kernel does
        not take these tensors (the caller runs its own loop)."""
        ...


class OnlineQuantizedMoEMethod:
    """Float experts loaded, then quantized per expert and output channel by ``quantize``;
    run by ``matmul``, or by the device's grouped kernel where ``grouped`` says the weights and
    activations are in its form (see the module's docstring)."""

    def __init__(self, quantize: ExpertQuantizer, matmul: QuantizedMatmul, grouped: bool = False) -> None:
        self.quantize = quantize
        self.matmul = matmul
        self.grouped = grouped

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_rank: int, params_dtype: torch.dtype) -> None:
        from tokenmill.layers.moe import UnquantizedFusedMoEMethod

        UnquantizedFusedMoEMethod().create_weights(layer, num_experts, hidden_size, intermediate_size_per_rank,
                                                   params_dtype)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        for name in EXPERT_WEIGHTS:
            weight, scale = quantize_experts(cast(torch.Tensor, getattr(layer, name)).data, self.quantize)
            layer.add_parameter(name, weight)
            layer.add_parameter(f"{name}_scale", scale)

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        ops = layer_ops(x.device)
        if self.grouped and isinstance(ops, QuantizedFusedMoEOps):
            w13, w13_scale, w2, w2_scale = (cast(torch.Tensor, getattr(layer, name)) for name in (
                "gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"))
            out = ops.quantized_fused_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
            if out is not None:
                return out

        def expert_matmul(stack: str, expert: int, rows: torch.Tensor) -> torch.Tensor:
            weight, scale = cast(torch.Tensor, getattr(layer, stack)), cast(torch.Tensor, getattr(layer, f"{stack}_scale"))
            return self.matmul(rows, weight[expert], scale[expert])

        return apply_experts_one_by_one(x, topk_weights, topk_ids, expert_matmul)


# (stack: "gate_up_proj" | "down_proj", expert index, activations [M, K]) -> [M, N] in their dtype
ExpertMatmul = Callable[[str, int, torch.Tensor], torch.Tensor]


def apply_experts_one_by_one(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                             expert_matmul: ExpertMatmul) -> torch.Tensor:
    """The SiLU-gated experts run one at a time over the tokens routed to each (only the experts
    that got tokens), each output weighted by its routing weight and summed per token: the loop a
    quantized expert method runs until it has a grouped kernel, given its per-expert matmul."""
    ops = layer_ops(x.device)
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slot = torch.where(topk_ids == expert)
        hidden = ops.silu_and_mul(expert_matmul("gate_up_proj", expert, x[tokens]))
        hidden = expert_matmul("down_proj", expert, hidden) * topk_weights[tokens, slot, None]
        out.index_add_(0, tokens, hidden.to(out.dtype))
    return out


def expert_tensor_name(layer: FusedMoE, stack: str, shard_id: int | None, expert_id: int | None, leaf: str) -> str:
    """The checkpoint name of one expert's ``leaf`` tensor (``<prefix>.<expert>.<w1|gate_proj...>.<leaf>``),
    or, without an expert, the stacked parameter's (``<prefix>.<stack>_<leaf>``): what errors name.
    ``expert_id`` is the expert's index in the layer's stack, as weight loaders get it (under expert
    parallelism the name carries its global id)."""
    if expert_id is None:
        return f"{layer.prefix}.{stack}_{leaf}"
    projection = layer.expert_names[2] if stack == "down_proj" else layer.expert_names[shard_id or 0]
    return f"{layer.prefix}.{layer.placement.expert_at(expert_id)}.{projection}.{leaf}"


def missing_expert_tensors(layer: FusedMoE, loaded: set[tuple[int, str, int | None, str]],
                           leaves: tuple[str, ...]) -> list[str]:
    """The checkpoint names of each of the layer's experts' ``leaves`` that are not in ``loaded``
    (keyed ``(expert in the stack, stack, shard, leaf)``: gate and up are shards 0 and 1 of
    ``gate_up_proj``)."""
    return [expert_tensor_name(layer, stack, shard, expert, leaf)
            for expert in range(layer.num_local_experts)
            for stack, shards in (("gate_up_proj", (0, 1)), ("down_proj", (None,)))
            for shard in shards for leaf in leaves
            if (expert, stack, shard, leaf) not in loaded]


def quantize_experts(weight: torch.Tensor, quantize: ExpertQuantizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked float experts ``[E, N, K]`` -> ``(quantized [E, N, K], scales [E, N])``, expert by expert."""
    pairs = [quantize(weight[expert]) for expert in range(weight.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s.reshape(-1).float() for _, s in pairs])
