"""AWQ experts: a MoE layer of an AWQ (GEMM layout) checkpoint, each expert's projections
packed as the linear layers' are (:mod:`tokenmill_quant_awq.method`), stacked over the experts.

A checkpoint stores every expert's ``w1`` / ``w3`` / ``w2`` (or ``gate_proj`` / ``up_proj`` /
``down_proj``) as ``qweight`` / ``qzeros`` / ``scales``; the layer holds, for ``E`` experts
of hidden size ``H`` and intermediate size ``I`` (``G(K) = K / group_size``):

* ``gate_up_proj_qweight`` int32 ``[E, H, 2I / 8]``: an expert's gate columns' words, then
  its up columns'; ``down_proj_qweight`` ``[E, I, H / 8]``; ``*_qzeros`` ``[E, G, N / 8]``,
  all rewritten at load from AWQ's interleaved nibble order to the natural one;
* ``*_scales`` float32 ``[E, G, N]``.

The experts run one at a time over those that got tokens, each through the linear layers'
packed-int CPU kernel (each expert's projections packed for it once, at load,
:func:`tokenmill.layers.cpu_packed_int_experts`), or, where that does not run, dequantised whole
and multiplied in the activations' dtype (the linear layers' torch path).

Under tensor parallelism (without expert parallelism) every expert is split by its
intermediate dimension, as the float experts are: rank ``r`` of ``T`` holds gate and up's
output columns ``[r I/T, (r+1) I/T)`` (whole packed words of ``qweight`` / ``qzeros``, so
``I / T`` is a multiple of 8, and those ``scales`` columns) and down's input rows of that
range with their own whole groups of ``qzeros`` / ``scales`` (``I / T`` a multiple of
``group_size``; one group over all inputs is the same on every rank).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from tokenmill.layers import (
    CpuPackedInt,
    apply_experts_one_by_one,
    cpu_packed_int_experts,
    cpu_packed_int_linear,
    dequantize_grouped,
    expert_tensor_name,
    missing_expert_tensors,
    unpack_columns,
)
from tokenmill_quant_awq.method import BITS, PER_WORD, awq_to_natural

if TYPE_CHECKING:
    from tokenmill.layers import FusedMoE

LEAVES = ("qweight", "qzeros", "scales")


class AwqFusedMoEMethod:
    """Packed AWQ experts, loaded per expert, each run by the packed-int CPU kernel (or dequantised)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.cpu_experts: dict[str, list[CpuPackedInt]] | None = None  # the CPU kernel's copy, by stack
        self.loaded: set[tuple[int, str, int | None, str]] = set()  # (expert, stack, shard, leaf)
        self.rank, self.world_size = 0, 1  # set by create_weights

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_rank: int, params_dtype: torch.dtype) -> None:
        inter = intermediate_size_per_rank
        self.rank, self.world_size = layer.loader.rank, layer.loader.world_size  # (1 under expert parallelism)
        if self.world_size > 1 and self.group_size != -1 and inter % self.group_size:
            raise ValueError(f"{layer.prefix}: an expert intermediate size of {inter * self.world_size} over "
                             f"{self.world_size} tensor-parallel ranks is {inter} per rank, not a multiple of "
                             f"AWQ group_size {self.group_size}: a group of down_proj's inputs would straddle "
                             "two ranks")
        for stack, k, n, width in (("gate_up_proj", hidden_size, 2 * inter, inter),
                                   ("down_proj", inter, hidden_size, hidden_size)):
            group = k if self.group_size == -1 else self.group_size
            if k % group or width % PER_WORD:
                raise ValueError(f"{layer.prefix}.{stack}: {k} inputs in AWQ groups of {group} and outputs of "
                                 f"{width} a projection (multiples of {PER_WORD} needed) do not divide")
            groups = k // group
            for leaf, data in (("qweight", torch.zeros(num_experts, k, n // PER_WORD, dtype=torch.int32)),
                               ("qzeros", torch.zeros(num_experts, groups, n // PER_WORD, dtype=torch.int32)),
                               ("scales", torch.zeros(num_experts, groups, n, dtype=torch.float32))):
                param = layer.add_parameter(f"{stack}_{leaf}", data)
                param.weight_loader = functools.partial(  # type: ignore[attr-defined]
                    self._load, layer, stack, leaf, width)
            layer.register_buffer(f"{stack}_g_idx", (torch.arange(k) // group).to(torch.int32), persistent=False)

    def _load(self, layer: FusedMoE, stack: str, leaf: str, width: int, param: nn.Parameter, loaded: torch.Tensor,
              shard_id: int | None = None, expert_id: int | None = None) -> None:
        name = self.tensor_name(layer, stack, shard_id, expert_id, leaf)
        if expert_id is None:
            raise ValueError(f"{name}: AWQ experts are read per expert (experts.N.<projection>.{leaf}), "
                             "not as a stacked tensor")
        if leaf != "scales" and loaded.dtype != torch.int32:
            raise ValueError(f"{name}: expected packed int32, the checkpoint has {loaded.dtype}")
        columns = width if leaf == "scales" else width // PER_WORD
        loaded = self._rank_part(stack, leaf, loaded, layer.intermediate_size_per_rank)
        expert = param.data[expert_id]
        target = expert if shard_id is None else expert.narrow(1, shard_id * columns, columns)
        if loaded.shape != target.shape:
            raise ValueError(f"{name}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit expert "
                             f"{layer.placement.expert_at(expert_id)} of {layer.prefix}.{stack}_{leaf} "
                             f"(expects {tuple(target.shape)}{' on this rank' if self.world_size > 1 else ''}; "
                             f"group_size {self.group_size})")
        target.copy_(loaded.float() if leaf == "scales" else awq_to_natural(loaded))
        self.loaded.add((expert_id, stack, shard_id, leaf))

    def _rank_part(self, stack: str, leaf: str, loaded: torch.Tensor, inter: int) -> torch.Tensor:
        """This rank's part of one expert's whole checkpoint tensor: gate/up's intermediate output
        columns (whole words of the packed leaves), down's intermediate input rows and their groups.
        A tensor of another size is returned as is, for the shape check to name."""
        if self.world_size == 1 or loaded.dim() != 2:
            return loaded
        if stack == "gate_up_proj":
            columns = inter if leaf == "scales" else inter // PER_WORD
            if loaded.shape[1] != columns * self.world_size:
                return loaded
            return loaded.narrow(1, self.rank * columns, columns)
        if leaf != "qweight" and self.group_size == -1:
            return loaded  # one group over all inputs: the same on every rank
        rows = inter if leaf == "qweight" else inter // self.group_size
        if loaded.shape[0] != rows * self.world_size:
            return loaded
        return loaded.narrow(0, self.rank * rows, rows)

    tensor_name = staticmethod(expert_tensor_name)

    def missing_checkpoint_tensors(self, layer: FusedMoE) -> list[str]:
        """Each expert's ``qweight`` / ``qzeros`` / ``scales`` that never came."""
        return missing_expert_tensors(layer, self.loaded, LEAVES)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Once, after loading: the experts packed for the CPU kernel, where it takes them."""
        if cast(torch.Tensor, layer.down_proj_qweight).device.type != "cpu":
            return

        def values(stack: str, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            qweight, zeros, scales = (cast(torch.Tensor, getattr(layer, f"{stack}_{leaf}"))[expert] for leaf in LEAVES)
            return (unpack_columns(qweight, BITS), unpack_columns(zeros, BITS), scales,
                    cast(torch.Tensor, getattr(layer, f"{stack}_g_idx")))

        self.cpu_experts = cpu_packed_int_experts(values, layer.num_local_experts, BITS, "awq")

    def expert_matmul(self, layer: FusedMoE, stack: str, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """``rows [M, K]`` by expert ``expert``'s ``stack`` weight ``[K, N]``, in their dtype."""
        if self.cpu_experts is not None:
            return cpu_packed_int_linear(rows, self.cpu_experts[stack][expert])
        return rows @ self.expert_weight(layer, stack, expert, rows.dtype)

    def expert_weight(self, layer: FusedMoE, stack: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``expert``'s ``stack`` weight, dequantised ``[K, N]``."""
        qweight, zeros, scales = (cast(torch.Tensor, getattr(layer, f"{stack}_{leaf}"))[expert] for leaf in LEAVES)
        return dequantize_grouped(unpack_columns(qweight, BITS), unpack_columns(zeros, BITS), scales,
                                  cast(torch.Tensor, getattr(layer, f"{stack}_g_idx")), dtype)

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return apply_experts_one_by_one(x, topk_weights, topk_ids, functools.partial(self.expert_matmul, layer))
