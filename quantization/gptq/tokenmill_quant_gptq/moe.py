"""GPTQ experts: a MoE layer of a GPTQ checkpoint, each expert's projections packed as the
linear layers' are (:mod:`tokenmill_quant_gptq.method`), stacked over the experts.

A checkpoint stores every expert's ``w1`` / ``w3`` / ``w2`` (or ``gate_proj`` / ``up_proj`` /
``down_proj``) as ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``; the layer holds, for ``E``
experts of hidden size ``H`` and intermediate size ``I`` (``p = 32 / bits``, ``G(K)`` groups
over ``K`` inputs):

* ``gate_up_proj_qweight`` int32 ``[E, H / p, 2I]``: an expert's gate columns, then its up
  columns (the two share their input, so one matmul); ``down_proj_qweight`` ``[E, I / p, H]``;
* ``*_qzeros`` unpacked ``[E, G, N]`` (v1's offset of one added back, as for the linear
  layers), ``*_scales`` float32 ``[E, G, N]``;
* ``*_g_idx`` int32 ``[E, K]``: gate and up of one expert must agree on it (act-order is
  a property of the input), as a merged linear layer's shards must.

The experts run one at a time over those that got tokens (the float reference's loop), each
through the linear layers' packed-int kernel: on the CPU the C++ one (each expert's projections
packed for it once, at load, :func:`tokenmill.layers.cpu_packed_int_experts`), on CUDA with triton
the Triton matmul; elsewhere each expert is dequantised whole and multiplied in the activations'
dtype.

Under tensor parallelism (without expert parallelism) every expert is split by its
intermediate dimension, as the float experts are: rank ``r`` of ``T`` holds gate and up's
output columns ``[r I/T, (r+1) I/T)`` (of ``qweight``, the unpacked ``qzeros`` and
``scales``; ``g_idx`` over the hidden inputs whole) and down's input rows of the same range
(``I / T / p`` packed ``qweight`` rows, and, without act-order, its own whole groups of
``qzeros`` / ``scales`` with ``g_idx`` counted from its first group, so ``I / T`` must be a
multiple of ``group_size``; with act-order a rank's rows belong to any group, so it keeps
every group and its rows' ``g_idx``), as the row-parallel linear layers do.
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
    expert_tensor_name,
    missing_expert_tensors,
)
from tokenmill_quant_gptq.kernels import gptq_dequantize, unpack_columns, unpack_rows, values_per_word
from tokenmill_quant_gptq.method import GptqScheme, choose_packed_int_kernel

if TYPE_CHECKING:
    from tokenmill.layers import FusedMoE

STACKS = ("gate_up_proj", "down_proj")
REQUIRED_LEAVES = ("qweight", "qzeros", "scales")  # g_idx may be left out (no act-order)


class GptqFusedMoEMethod:
    """Packed GPTQ experts, loaded per expert, each run by the packed-int kernel (or dequantised)."""

    def __init__(self, scheme: GptqScheme) -> None:
        self.scheme = scheme
        self.kernel = "torch"  # chosen once the weights are on their device
        self.cpu_experts: dict[str, list[CpuPackedInt]] | None = None  # the CPU kernel's copy, by stack
        self.loaded: set[tuple[int, str, int | None, str]] = set()  # (expert, stack, shard, leaf)
        self.rank, self.world_size, self.down_group_mode = 0, 1, "whole"  # set by create_weights

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_rank: int, params_dtype: torch.dtype) -> None:
        per_word = values_per_word(self.scheme.bits)
        inter = intermediate_size_per_rank
        self.rank, self.world_size = layer.loader.rank, layer.loader.world_size  # (1 under expert parallelism)
        self.down_group_mode = self._down_group_mode(layer, inter)
        per_rank = f" per rank (over {self.world_size} tensor-parallel ranks)" if self.world_size > 1 else ""
        for what, size in (("hidden size", hidden_size), (f"expert intermediate size{per_rank}", inter)):
            if size % per_word:
                raise ValueError(f"{layer.prefix}: a {what} of {size} is not a multiple of {per_word} "
                                 f"({self.scheme.bits}-bit values, {per_word} to an int32 word)")
        # (stack, inputs K, outputs N, shard width: the columns one checkpoint tensor fills)
        for stack, k, n, width in (("gate_up_proj", hidden_size, 2 * inter, inter),
                                   ("down_proj", inter, hidden_size, hidden_size)):
            replicated = stack == "down_proj" and self.down_group_mode == "replicated"
            groups = self.scheme.groups(k * self.world_size if replicated else k)
            g_idx = (self.scheme.group_of(k * self.world_size).narrow(0, self.rank * k, k) if replicated
                     else self.scheme.group_of(k))
            shapes = {"qweight": (torch.zeros(num_experts, k // per_word, n, dtype=torch.int32)),
                      "qzeros": torch.full((num_experts, groups, n), -1, dtype=torch.int32),
                      "scales": torch.zeros(num_experts, groups, n, dtype=torch.float32),
                      "g_idx": g_idx.repeat(num_experts, 1)}
            for leaf, data in shapes.items():
                param = layer.add_parameter(f"{stack}_{leaf}", data)
                param.weight_loader = functools.partial(  # type: ignore[attr-defined]
                    self._load, layer, stack, leaf, width)

    def _down_group_mode(self, layer: FusedMoE, inter: int) -> str:
        """How down's groups (over the intermediate inputs) fall on the ranks: ``"split"`` (each
        rank its own run of whole groups), ``"replicated"`` (act-order: every rank all groups), or
        ``"whole"`` (one rank, or one group over all inputs, the same on every rank)."""
        if self.world_size == 1 or self.scheme.group_size == -1:
            return "whole"
        if self.scheme.desc_act:
            return "replicated"
        if inter % self.scheme.group_size:
            raise ValueError(f"{layer.prefix}: an expert intermediate size of {inter * self.world_size} over "
                             f"{self.world_size} tensor-parallel ranks is {inter} per rank, not a multiple of "
                             f"GPTQ group_size {self.scheme.group_size}: a group of down_proj's inputs would "
                             "straddle two ranks")
        return "split"

    def _rank_part(self, stack: str, leaf: str, source: torch.Tensor, inter: int) -> torch.Tensor:
        """This rank's part of one expert's whole checkpoint tensor (``qzeros`` unpacked):
        gate/up's intermediate output columns, down's intermediate input rows (and groups).
        A tensor of another size is returned as is, for the shape check to name."""
        if self.world_size == 1 or source.dim() == 0:
            return source
        if stack == "gate_up_proj":
            if leaf == "g_idx" or source.dim() != 2 or source.shape[1] != inter * self.world_size:
                return source
            return source.narrow(1, self.rank * inter, inter)
        rows = {"qweight": inter // values_per_word(self.scheme.bits), "g_idx": inter}.get(leaf)
        if rows is None:  # qzeros / scales: their groups
            if self.down_group_mode != "split":
                return source
            rows = inter // self.scheme.group_size
        if source.shape[0] != rows * self.world_size:
            return source
        part = source.narrow(0, self.rank * rows, rows)
        if leaf == "g_idx" and self.down_group_mode == "split":  # counted from this rank's first group
            part = part - self.rank * (inter // self.scheme.group_size)
        return part

    def _load(self, layer: FusedMoE, stack: str, leaf: str, width: int, param: nn.Parameter, loaded: torch.Tensor,
              shard_id: int | None = None, expert_id: int | None = None) -> None:
        name = self.tensor_name(layer, stack, shard_id, expert_id, leaf)
        inter = layer.intermediate_size_per_rank
        if expert_id is None:
            raise ValueError(f"{name}: GPTQ experts are read per expert (experts.N.<projection>.{leaf}), "
                             "not as a stacked tensor")
        if leaf in ("qweight", "qzeros") and loaded.dtype != torch.int32:
            raise ValueError(f"{name}: expected packed int32, the checkpoint has {loaded.dtype}")
        expert = param.data[expert_id]
        if leaf == "g_idx":
            self._load_g_idx(name, expert, self._rank_part(stack, leaf, loaded.to(torch.int32), inter), stack,
                             shard_id, expert_id)
            return
        source = loaded.float() if leaf == "scales" else loaded
        if leaf == "qzeros":
            source = unpack_columns(loaded, self.scheme.bits) if loaded.dim() == 2 else loaded
            source = source + 1 if self.scheme.zero_version == 1 else source
        source = self._rank_part(stack, leaf, source, inter)
        target = expert if shard_id is None else expert.narrow(1, shard_id * width, width)
        if source.shape != target.shape:
            raise ValueError(f"{name}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit expert "
                             f"{layer.placement.expert_at(expert_id)} of {layer.prefix}.{stack}_{leaf} "
                             f"(expects {tuple(target.shape)}"
                             f"{' unpacked' if leaf == 'qzeros' else ''}{' on this rank' if self.world_size > 1 else ''}; "
                             f"group_size {self.scheme.group_size})")
        target.copy_(source)
        self.loaded.add((expert_id, stack, shard_id, leaf))

    def _load_g_idx(self, name: str, target: torch.Tensor, loaded: torch.Tensor, stack: str, shard_id: int | None,
                    expert_id: int) -> None:
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"{name}: shape {tuple(loaded.shape)} for {target.shape[0]} input features")
        loaded = loaded.to(torch.int32)
        other = None if shard_id is None else (expert_id, stack, 1 - shard_id, "g_idx")
        if other in self.loaded and not torch.equal(target, loaded):
            raise ValueError(f"{name}: the expert's gate and up projections have different g_idx (act orders); "
                             "they cannot share one matmul")
        target.copy_(loaded)
        self.loaded.add((expert_id, stack, shard_id, "g_idx"))

    tensor_name = staticmethod(expert_tensor_name)

    def missing_checkpoint_tensors(self, layer: FusedMoE) -> list[str]:
        """Each expert's ``qweight`` / ``qzeros`` / ``scales`` that never came."""
        return missing_expert_tensors(layer, self.loaded, REQUIRED_LEAVES)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        for stack in STACKS:
            scales, g_idx = self._param(layer, stack, "scales"), self._param(layer, stack, "g_idx")
            if g_idx.min() < 0 or g_idx.max() >= scales.shape[1]:
                raise ValueError(f"{layer.prefix}.{stack}_g_idx: group indices {int(g_idx.min())}.."
                                 f"{int(g_idx.max())} outside the {scales.shape[1]} groups of its scales")
        device = self._param(layer, "down_proj", "qweight").device
        if device.type == "cpu":  # the CPU kernel where it takes the experts (it logs which runs)

            def values(stack: str, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
                qweight, zeros, scales, g_idx = (self._param(layer, stack, leaf)[expert]
                                                 for leaf in ("qweight", "qzeros", "scales", "g_idx"))
                return unpack_rows(qweight, self.scheme.bits), zeros, scales, g_idx

            self.cpu_experts = cpu_packed_int_experts(values, layer.num_local_experts, self.scheme.bits, "gptq")
        self.kernel = "cpu" if self.cpu_experts is not None else choose_packed_int_kernel(device)

    @staticmethod
    def _param(layer: FusedMoE, stack: str, leaf: str) -> torch.Tensor:
        return cast(torch.Tensor, getattr(layer, f"{stack}_{leaf}"))

    def expert_matmul(self, layer: FusedMoE, stack: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` by expert ``expert``'s ``stack`` weight ``[K, N]``, in ``x``'s dtype."""
        if self.cpu_experts is not None:
            return cpu_packed_int_linear(x, self.cpu_experts[stack][expert])
        qweight, zeros, scales, g_idx = (self._param(layer, stack, leaf)[expert]
                                         for leaf in ("qweight", "qzeros", "scales", "g_idx"))
        if self.kernel == "triton":
            from tokenmill_quant_gptq.triton_kernels import packed_int_linear_triton

            return packed_int_linear_triton(x, qweight, zeros, scales, g_idx, self.scheme.bits, None)
        return x @ gptq_dequantize(qweight, zeros, scales, g_idx, self.scheme.bits, x.dtype)

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return apply_experts_one_by_one(x, topk_weights, topk_ids, functools.partial(self.expert_matmul, layer))
