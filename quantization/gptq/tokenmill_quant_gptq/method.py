"""The GPTQ linear method: packed weights, zeros, scales and group indices, and their loaders.

Parameters (the checkpoint's names under each layer's prefix), for ``K`` inputs,
``N`` outputs, ``p = 32 / bits`` values a word and ``G = ceil(K / group_size)``:

* ``qweight``: int32 ``[K / p, N]``, kept packed (this is the memory saving);
* ``qzeros``: int32 ``[G, N / p]`` on disk; unpacked at load into ``[G, N]`` (v1
  checkpoints' offset of one added back), small next to the weight, so that the
  shards of a merged layer (q/k/v, gate/up) need not start on a word boundary;
* ``scales``: ``[G, N]`` (float16 on disk), kept as float32;
* ``g_idx``: int32 ``[K]``, the group of each input channel. Without ``desc_act``
  it is ``k // group_size`` (the default when a checkpoint leaves it out); the
  shards of a merged layer multiply one input, so they must agree on it.

Shapes are checked at load against the layer's: a checkpoint whose group count
does not match ``group_size`` is refused with both numbers, never run.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from tokenmill.layers import CpuPackedInt, Linear, OutputShardLoader, cpu_packed_int_linear, cpu_packed_int_weights
from tokenmill_quant_gptq.kernels import (
    dequantized_linear,
    gptq_dequantize,
    unpack_columns,
    unpack_rows,
    values_per_word,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GptqScheme:
    bits: int
    group_size: int  # -1: one group over all inputs
    desc_act: bool
    sym: bool
    zero_version: int  # 1: stored zero = real zero - 1 (checkpoint_format "gptq"); 2: stored as is

    def groups(self, input_size: int) -> int:
        return 1 if self.group_size == -1 else math.ceil(input_size / self.group_size)

    def group_of(self, input_size: int) -> torch.Tensor:
        """The ``g_idx`` of a checkpoint without act-order."""
        size = input_size if self.group_size == -1 else self.group_size
        return (torch.arange(input_size) // size).to(torch.int32)


class GptqLinearMethod:
    """On CUDA with triton, the packed weight dequantised inside a Triton matmul; on a CPU with
    AVX-512 the shared packed-int kernel (tokenmill.layers.packed_int_cpu, the weights repacked once at
    load); elsewhere dequantise the whole weight, then one matmul in the activations' dtype (the torch path)."""

    def __init__(self, scheme: GptqScheme) -> None:
        self.scheme = scheme
        self.kernel = "torch"  # chosen once the weights are on their device
        self.cpu_weights: CpuPackedInt | None = None  # the CPU kernel's layout, when it runs

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        check_layer_shape(layer, self.scheme, input_size, output_partition_sizes)
        split_groups = _splits_groups(layer, self.scheme)
        group_input = input_size * (layer.output_loader.world_size if _replicates_groups(layer, self.scheme) else 1)
        per_word, groups, outputs = values_per_word(self.scheme.bits), self.scheme.groups(group_input), \
            sum(output_partition_sizes)
        shards, group_dim = layer.output_loader, 0 if split_groups else None
        layer.add_parameter("qweight", torch.zeros(input_size // per_word, outputs, dtype=torch.int32), output_dim=1,
                            input_dim=0, weight_loader=functools.partial(_load_qweight, shards))
        layer.add_parameter("qzeros", torch.full((groups, outputs), -1, dtype=torch.int32), output_dim=1,
                            input_dim=group_dim,
                            weight_loader=functools.partial(_load_qzeros, shards, self.scheme, input_size))
        layer.add_parameter("scales", torch.zeros(groups, outputs, dtype=torch.float32), output_dim=1,
                            input_dim=group_dim,
                            weight_loader=functools.partial(_load_scales, shards, self.scheme, input_size))
        g_idx = layer.add_parameter("g_idx", self.scheme.group_of(input_size), input_dim=0,
                                    weight_loader=functools.partial(_load_g_idx, shards,
                                                                    groups if split_groups else 0))
        g_idx.shards_loaded = 0  # type: ignore[attr-defined]  # read by _load_g_idx

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        linear = cast(Linear, layer)
        zeros, scales, g_idx = (cast(torch.Tensor, getattr(layer, name)) for name in ("qzeros", "scales", "g_idx"))
        if (zeros < 0).any():
            raise ValueError(f"{linear.prefix}: the checkpoint has no qzeros for some output shard")
        if g_idx.min() < 0 or g_idx.max() >= scales.shape[0]:
            raise ValueError(f"{linear.prefix}.g_idx: group indices {int(g_idx.min())}..{int(g_idx.max())} outside "
                             f"the {scales.shape[0]} groups of its scales")
        if zeros.device.type == "cpu":  # the CPU kernel where it takes the layer (it logs which runs)
            self.cpu_weights = cpu_packed_int_weights(
                unpack_rows(cast(torch.Tensor, layer.qweight), self.scheme.bits), zeros, scales, g_idx,
                self.scheme.bits, cast(torch.Tensor | None, layer.bias), "gptq")
            self.kernel = "cpu" if self.cpu_weights is not None else "torch"
        else:
            self.kernel = choose_packed_int_kernel(zeros.device)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_weights is not None:
            return cpu_packed_int_linear(x, self.cpu_weights)
        if self.kernel == "triton":
            from tokenmill_quant_gptq.triton_kernels import packed_int_linear_triton

            out = packed_int_linear_triton(x.reshape(-1, x.shape[-1]), cast(torch.Tensor, layer.qweight),
                                           cast(torch.Tensor, layer.qzeros), cast(torch.Tensor, layer.scales),
                                           cast(torch.Tensor, layer.g_idx), self.scheme.bits,
                                           cast(torch.Tensor | None, layer.bias))
            return out.reshape(*x.shape[:-1], out.shape[1])
        weight = gptq_dequantize(cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.qzeros),
                                 cast(torch.Tensor, layer.scales), cast(torch.Tensor, layer.g_idx), self.scheme.bits,
                                 x.dtype)
        out = dequantized_linear(x.reshape(-1, x.shape[-1]), weight, cast(torch.Tensor | None, layer.bias))
        return out.reshape(*x.shape[:-1], weight.shape[1])


@functools.cache
def choose_packed_int_kernel(device: torch.device) -> str:
    """``"triton"`` on CUDA where triton imports, else ``"torch"``; logged once per device."""
    kernel, reason = "torch", f"dequantise, then matmul ({device.type})"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            reason = "triton is not installed"
        else:
            kernel, reason = "triton", "packed weights dequantised inside the matmul"
    logger.info("gptq linear layers on %s: %s kernel (%s)", device, kernel, reason)
    return kernel


def check_layer_shape(layer: Linear, scheme: GptqScheme, input_size: int, output_partition_sizes: list[int]) -> None:
    """Refuse, at build time, a layer the packed layout cannot describe."""
    per_word = values_per_word(scheme.bits)
    per_rank = " per rank" if layer.parallel == "row" else ""
    if input_size % per_word:
        raise ValueError(f"{layer.prefix}: {input_size} input features{per_rank} are not a multiple of {per_word} "
                         f"({scheme.bits}-bit values, {per_word} to an int32 word of qweight)")
    if _splits_groups(layer, scheme) and input_size % scheme.group_size:
        raise ValueError(f"{layer.prefix}: {input_size} input features per rank over "
                         f"{layer.output_loader.world_size} tensor-parallel ranks do not hold whole groups of "
                         f"{scheme.group_size} (GPTQ group_size)")
    for size in output_partition_sizes:
        if size % per_word:
            raise ValueError(f"{layer.prefix}: an output shard of {size} features is not a multiple of {per_word} "
                             f"(qzeros packs {per_word} outputs to a word)")


def _splits_groups(layer: Linear, scheme: GptqScheme) -> bool:
    """A row-parallel layer without act-order holds its own inputs' groups: rank ``r`` the
    ``r``-th run of whole groups. (One group over all inputs is the same on every rank.)"""
    return layer.parallel == "row" and not scheme.desc_act and scheme.group_size != -1


def _replicates_groups(layer: Linear, scheme: GptqScheme) -> bool:
    """With act-order a rank's inputs belong to any of the groups, so a row-parallel layer keeps
    every group's zeros and scales (a sixteenth of the packed weight at 4 bits, groups of 128)
    and its slice of ``g_idx`` points into them."""
    return layer.parallel == "row" and scheme.desc_act and scheme.group_size != -1


def _load_qweight(shards: OutputShardLoader, param: nn.Parameter, loaded: torch.Tensor,
                  shard_id: int | None = None) -> None:
    if loaded.dtype != torch.int32:
        raise ValueError(f"{shards.prefix}.qweight: expected packed int32, the checkpoint has {loaded.dtype}")
    shards(param, loaded, shard_id)


def _check_groups(shards: OutputShardLoader, name: str, scheme: GptqScheme, input_size: int, param: nn.Parameter,
                  loaded: torch.Tensor) -> None:
    """The checkpoint's (whole layer's) group count against the layer's: a row-parallel
    layer that splits its groups holds ``1 / world_size`` of them."""
    split = shards.input_split and getattr(param, "input_dim", None) is not None
    groups, inputs = param.shape[0] * (shards.world_size if split else 1), \
        input_size * (shards.world_size if shards.input_split else 1)
    if loaded.dim() != 2 or loaded.shape[0] != groups:
        raise ValueError(f"{shards.prefix}.{name}: shape {tuple(loaded.shape)}, but group_size {scheme.group_size} "
                         f"over {inputs} input features makes {groups} groups (rows)")


def _load_qzeros(shards: OutputShardLoader, scheme: GptqScheme, input_size: int, param: nn.Parameter,
                 loaded: torch.Tensor, shard_id: int | None = None) -> None:
    if loaded.dtype != torch.int32:
        raise ValueError(f"{shards.prefix}.qzeros: expected packed int32, the checkpoint has {loaded.dtype}")
    _check_groups(shards, "qzeros", scheme, input_size, param, loaded)
    zeros = unpack_columns(loaded, scheme.bits)
    shards(param, zeros + 1 if scheme.zero_version == 1 else zeros, shard_id)


def _load_scales(shards: OutputShardLoader, scheme: GptqScheme, input_size: int, param: nn.Parameter,
                 loaded: torch.Tensor, shard_id: int | None = None) -> None:
    _check_groups(shards, "scales", scheme, input_size, param, loaded)
    shards(param, loaded.float(), shard_id)


def _load_g_idx(shards: OutputShardLoader, rank_groups: int, param: nn.Parameter, loaded: torch.Tensor,
                shard_id: int | None = None) -> None:
    """``rank_groups``: the groups each rank holds when a row-parallel layer splits them (this
    rank's slice of ``g_idx`` then counts from its first group), else 0."""
    inputs = param.shape[0] * (shards.world_size if shards.input_split else 1)
    if tuple(loaded.shape) != (inputs,):
        raise ValueError(f"{shards.prefix}.g_idx: shape {tuple(loaded.shape)} for {inputs} input features")
    loaded = shards.rank_slice(param, loaded.to(torch.int32), None) - shards.rank * rank_groups
    if param.shards_loaded and not torch.equal(param.data, loaded):  # type: ignore[attr-defined]
        raise ValueError(f"{shards.prefix}: the merged projections have different g_idx (act orders); "
                         "they cannot share one matmul")
    param.data.copy_(loaded)
    param.shards_loaded += 1  # type: ignore[attr-defined]
