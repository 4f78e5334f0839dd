"""Linear layers with a quantization-method slot and per-parameter weight loaders.

A layer takes its method from the build context's quantization config (the float
method when there is none, or when the config leaves the layer out), then lets the
method create the parameters, once the output partition sizes (``MergedLinear``'s
q/k/v or gate/up shards) and the params dtype are known. Every parameter carries a
``weight_loader(param, tensor, shard_id=None)``, which a model's ``load_weights``
calls through :func:`load_weight`: the layer's default one (:class:`OutputShardLoader`)
copies a checkpoint tensor whole, or into shard ``shard_id``'s slice along the
parameter's ``output_dim``, so parameters of any layout (an int8 ``[out, in]`` weight,
``[out]`` scales) load the same way; a method with another layout sets its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol, cast

import torch
from torch import nn

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.ops import layer_ops


class WeightLoader(Protocol):
    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None: ...


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """Copy a whole checkpoint tensor into a parameter of the same shape."""
    if shard_id is not None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} has no shards (got shard {shard_id})")
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} for a parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_weight(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """Load ``loaded`` into ``param`` through the parameter's own weight loader."""
    loader = cast(WeightLoader, getattr(param, "weight_loader", default_weight_loader))
    loader(param, loaded, shard_id)


class LinearMethod(Protocol):
    """How a linear layer's weights are stored and multiplied. ``create_weights``
    registers them on ``layer`` (:meth:`Linear.add_parameter`); an optional
    ``process_weights_after_loading(layer)`` is called once all are loaded."""

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every linear layer's method its one look at the loaded weights (to repack
    them, say). Methods without ``process_weights_after_loading`` are left alone."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        hook = getattr(method, "process_weights_after_loading", None)
        if hook is not None:
            hook(module)


class UnquantizedLinearMethod:
    """Plain weights; the platform's layer ops may keep a prepared (packed) copy too."""

    def create_weights(self, layer: Linear, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        layer.add_parameter("weight", torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype),
                            output_dim=0, input_dim=1)
        layer.register_buffer("prepared_weight", None, persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight)
        setattr(layer, "prepared_weight", layer_ops(weight.device).prepare_linear_weight(weight))  # noqa: B010 (a buffer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer_ops(x.device).linear(x, cast(torch.Tensor, layer.weight), cast(torch.Tensor | None, layer.bias),
                                          cast(torch.Tensor | None, layer.prepared_weight))


@dataclasses.dataclass(frozen=True)
class OutputShardLoader:
    """A linear layer's default weight loader: a checkpoint tensor fills the whole
    parameter, or, with a ``shard_id``, that output shard's slice along the
    parameter's ``output_dim``. It holds the layer's shard layout rather than the
    layer, so parameters do not keep their layer alive.

    Under tensor parallelism it first cuts this rank's slice out of the checkpoint
    tensor: output shard ``i`` is split into ``shard_parts[i]`` equal parts along
    ``output_dim`` (``world_size`` parts, or fewer for K/V heads replicated over
    ranks: rank ``r`` reads part ``r * parts // world_size``), and a row-parallel
    layer's ``input_dim`` into ``world_size`` parts. A parameter marked ``added_once``
    (a row-parallel bias, added before the all-reduce) is zero on every rank but 0.
    With one rank every tensor is copied as it comes.
    """

    prefix: str
    partition_sizes: tuple[int, ...]  # this rank's size of each output shard
    shard_parts: tuple[int, ...] = ()  # per shard: how many parts it is split into (empty: 1 each)
    rank: int = 0
    world_size: int = 1
    input_split: bool = False  # row-parallel: the input dimension is split over the ranks

    def shard_slice(self, shard_id: int) -> tuple[int, int]:
        if not 0 <= shard_id < len(self.partition_sizes):
            raise ValueError(f"{self.prefix or 'the layer'} has {len(self.partition_sizes)} output shards, "
                             f"not a shard {shard_id}")
        return sum(self.partition_sizes[:shard_id]), self.partition_sizes[shard_id]

    def rank_slice(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> torch.Tensor:
        """The part of checkpoint tensor ``loaded`` that this rank holds."""
        if self.world_size == 1:
            return loaded
        out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        parts = self.shard_parts[shard_id or 0] if self.shard_parts else 1
        if parts > 1 and out_dim is not None:
            if shard_id is None and len(self.partition_sizes) > 1:
                raise ValueError(f"{self.prefix}: a merged layer split over ranks loads shard by shard")
            loaded = _output_part(loaded, out_dim, self.rank * parts // self.world_size, parts)
        if self.input_split and in_dim is not None:
            size = loaded.shape[in_dim] // self.world_size
            loaded = loaded.narrow(in_dim, self.rank * size, size)
        if self.input_split and getattr(param, "added_once", False) and self.rank != 0:
            loaded = torch.zeros_like(loaded)
        return loaded

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        loaded = self.rank_slice(param, loaded, shard_id)
        target = param.data
        if shard_id is not None:
            dim = getattr(param, "output_dim", None)
            if dim is None:
                raise ValueError(f"{self.prefix}: a parameter without an output dimension has no shard {shard_id}")
            target = target.narrow(dim, *self.shard_slice(shard_id))
        if target.shape != loaded.shape:
            where = f"shard {shard_id} of " if shard_id is not None else ""
            raise ValueError(f"{self.prefix}: checkpoint tensor of shape {tuple(loaded.shape)} for {where}a "
                             f"parameter of shape {tuple(target.shape)}")
        target.copy_(loaded)


Parallel = Literal["none", "column", "row"]


class Linear(nn.Module):
    """``x @ W.T + b`` through the layer's method.

    ``output_partition_sizes`` splits the output into shards that the checkpoint
    stores as separate tensors (``MergedLinear`` passes its ``output_sizes``); by
    default the output is one shard. ``quant_method`` overrides the context's
    choice (a tied lm_head must stay float, say).

    ``parallel`` says how the layer splits over the context's tensor-parallel ranks:
    ``"column"`` splits each output shard (into ``shard_parts[i]`` parts, default the
    world size: fewer replicate a shard over ranks, as K/V heads when there are fewer
    than ranks), so each rank computes its slice of the output; ``"row"`` splits the
    input, and the ranks' partial outputs are summed by an all-reduce (the bias added
    on rank 0 only). ``"none"``, and any layer built for one rank, is the whole layer.
    ``in_features``, ``out_features`` and ``output_partition_sizes`` are this rank's.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 ctx: ModelBuildContext | None = None, quant_method: LinearMethod | None = None,
                 output_partition_sizes: Sequence[int] | None = None, parallel: Parallel = "none",
                 shard_parts: Sequence[int] | None = None) -> None:
        super().__init__()
        ctx = ctx if ctx is not None else ModelBuildContext(hf_config=None)
        sizes = list(output_partition_sizes) if output_partition_sizes is not None else [out_features]
        if sum(sizes) != out_features:
            raise ValueError(f"output partitions {sizes} do not add up to {out_features} features")
        world = ctx.world_size if parallel != "none" else 1
        parts = _shard_parts(ctx.prefix, sizes, world, shard_parts) if parallel == "column" else [1] * len(sizes)
        if parallel == "row" and in_features % world:
            raise ValueError(f"{ctx.prefix}: {in_features} input features do not split over {world} ranks")
        sizes = [size // n for size, n in zip(sizes, parts, strict=True)]
        self.in_features = in_features // world if parallel == "row" else in_features
        self.out_features = sum(sizes)
        self.output_partition_sizes = sizes
        self.parallel: Parallel = parallel if world > 1 else "none"
        self.comm = ctx.comm
        self.prefix = ctx.prefix
        self.output_loader = OutputShardLoader(ctx.prefix, tuple(sizes), tuple(parts), ctx.rank if world > 1 else 0,
                                               world, input_split=self.parallel == "row")
        self.params_dtype = ctx.params_dtype
        self.register_parameter("bias", None)
        if bias:
            param = self.add_parameter("bias", torch.empty(self.out_features, dtype=ctx.params_dtype), output_dim=0)
            param.added_once = self.parallel == "row"  # type: ignore[attr-defined]  # read by the loader
        self.quant_method: LinearMethod = quant_method or ctx.linear_method(self) or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.in_features, sizes, ctx.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)
        if self.parallel == "row":
            out = self.comm.all_reduce(out)
        return out

    def add_parameter(self, name: str, data: torch.Tensor, *, output_dim: int | None = None,
                      input_dim: int | None = None, weight_loader: WeightLoader | None = None) -> nn.Parameter:
        """Register ``data`` as parameter ``name`` (no grad). ``output_dim``: the dimension
        that runs over output features, where the default loader places a shard (and a
        column-parallel layer's rank slice); ``input_dim``: the one over input features
        (split in a row-parallel layer); ``weight_loader``: the parameter's own loader
        instead of :attr:`output_loader`."""
        param = nn.Parameter(data, requires_grad=False)
        param.output_dim = output_dim  # type: ignore[attr-defined]  # read by the loaders
        param.input_dim = input_dim  # type: ignore[attr-defined]
        param.weight_loader = weight_loader or self.output_loader  # type: ignore[attr-defined]
        self.register_parameter(name, param)
        return param

    def shard_slice(self, shard_id: int) -> tuple[int, int]:
        """``(offset, size)`` of output shard ``shard_id`` among the layer's output features."""
        return self.output_loader.shard_slice(shard_id)


class MergedLinear(Linear):
    """Several output projections of one input, computed as one matmul; the checkpoint
    holds one tensor per projection, loaded as shards 0, 1, ..."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, *,
                 ctx: ModelBuildContext | None = None, quant_method: LinearMethod | None = None,
                 parallel: Parallel = "none", shard_parts: Sequence[int] | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, ctx=ctx, quant_method=quant_method,
                         output_partition_sizes=output_sizes, parallel=parallel, shard_parts=shard_parts)

    @property
    def output_sizes(self) -> list[int]:
        return self.output_partition_sizes

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.output_partition_sizes, dim=-1))


def _shard_parts(prefix: str, sizes: list[int], world_size: int, shard_parts: Sequence[int] | None) -> list[int]:
    """How many parts each output shard of a column-parallel layer splits into (checked)."""
    parts = list(shard_parts) if shard_parts is not None else [world_size] * len(sizes)
    if len(parts) != len(sizes):
        raise ValueError(f"{prefix}: {len(parts)} shard splits for {len(sizes)} output shards")
    for size, n in zip(sizes, parts, strict=True):
        if n < 1 or world_size % n or size % n:
            raise ValueError(f"{prefix}: an output shard of {size} features does not split into {n} parts "
                             f"over {world_size} ranks")
    return parts


def _output_part(loaded: torch.Tensor, dim: int, part: int, parts: int) -> torch.Tensor:
    """Part ``part`` of ``parts`` equal parts of ``loaded`` along ``dim``. A tensor whose size
    does not divide (a vocabulary over ranks) is cut in parts of the rounded-up size, the
    last one padded with zeros."""
    total = loaded.shape[dim]
    size = -(-total // parts)
    start = min(part * size, total)
    piece = loaded.narrow(dim, start, min(size, total - start))
    if piece.shape[dim] == size:
        return piece
    padding = list(piece.shape)
    padding[dim] = size - piece.shape[dim]
    return torch.cat([piece, piece.new_zeros(padding)], dim=dim)
