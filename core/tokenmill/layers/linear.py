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
from typing import Protocol, cast

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
                            output_dim=0)
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
    layer, so parameters do not keep their layer alive."""

    prefix: str
    partition_sizes: tuple[int, ...]

    def shard_slice(self, shard_id: int) -> tuple[int, int]:
        if not 0 <= shard_id < len(self.partition_sizes):
            raise ValueError(f"{self.prefix or 'the layer'} has {len(self.partition_sizes)} output shards, "
                             f"not a shard {shard_id}")
        return sum(self.partition_sizes[:shard_id]), self.partition_sizes[shard_id]

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
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


class Linear(nn.Module):
    """``x @ W.T + b`` through the layer's method.

    ``output_partition_sizes`` splits the output into shards that the checkpoint
    stores as separate tensors (``MergedLinear`` passes its ``output_sizes``); by
    default the output is one shard. ``quant_method`` overrides the context's
    choice (a tied lm_head must stay float, say).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 ctx: ModelBuildContext | None = None, quant_method: LinearMethod | None = None,
                 output_partition_sizes: Sequence[int] | None = None) -> None:
        super().__init__()
        ctx = ctx if ctx is not None else ModelBuildContext(hf_config=None)
        sizes = list(output_partition_sizes) if output_partition_sizes is not None else [out_features]
        if sum(sizes) != out_features:
            raise ValueError(f"output partitions {sizes} do not add up to {out_features} features")
        self.in_features = in_features
        self.out_features = out_features
        self.output_partition_sizes = sizes
        self.prefix = ctx.prefix
        self.output_loader = OutputShardLoader(ctx.prefix, tuple(sizes))
        self.params_dtype = ctx.params_dtype
        self.register_parameter("bias", None)
        if bias:
            self.add_parameter("bias", torch.empty(out_features, dtype=ctx.params_dtype), output_dim=0)
        self.quant_method: LinearMethod = quant_method or ctx.linear_method(self) or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, sizes, ctx.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def add_parameter(self, name: str, data: torch.Tensor, *, output_dim: int | None = None,
                      weight_loader: WeightLoader | None = None) -> nn.Parameter:
        """Register ``data`` as parameter ``name`` (no grad). ``output_dim``: the dimension
        that runs over output features, where the default loader places a shard;
        ``weight_loader``: the parameter's own loader instead of :attr:`output_loader`."""
        param = nn.Parameter(data, requires_grad=False)
        param.output_dim = output_dim  # type: ignore[attr-defined]  # read by the loaders
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
                 ctx: ModelBuildContext | None = None, quant_method: LinearMethod | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, ctx=ctx, quant_method=quant_method,
                         output_partition_sizes=output_sizes)

    @property
    def output_sizes(self) -> list[int]:
        return self.output_partition_sizes

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.output_partition_sizes, dim=-1))
