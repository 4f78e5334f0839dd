"""Linear layers with a quantization-method slot.

A quant plugin replaces ``quant_method`` (how weights are created and how
``x @ W.T`` is computed); models only see these classes. ``MergedLinear``
stacks several projections (q/k/v, gate/up) into one matmul; its weight
loader copies each checkpoint tensor into its shard.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from tokenmill.layers.ops import layer_ops


class LinearMethod(Protocol):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None: ...
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...


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

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        # register_parameter accepts None: the layer then has a `bias` attribute that is None
        layer.register_parameter("bias", nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None)
        layer.register_buffer("prepared_weight", None, persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight)
        setattr(layer, "prepared_weight", layer_ops(weight.device).prepare_linear_weight(weight))  # noqa: B010 (a buffer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer_ops(x.device).linear(x, cast(torch.Tensor, layer.weight), cast(torch.Tensor | None, layer.bias),
                                          cast(torch.Tensor | None, layer.prepared_weight))


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        """Copy a checkpoint tensor (``weight`` or ``bias``) into this layer."""
        getattr(self, name).data.copy_(tensor)


class MergedLinear(Linear):
    """Several output projections of one input, computed as one matmul."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, quant_method)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            raise ValueError("MergedLinear needs the shard index of the checkpoint tensor")
        start, size = self.offsets[shard], self.output_sizes[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard} of {name} has {tensor.shape[0]} rows, expected {size}")
        getattr(self, name).data[start:start + size].copy_(tensor)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.output_sizes, dim=-1))
