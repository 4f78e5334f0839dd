"""Conformance of a quantization method: a linear layer against its dequantised weight.

The plugin gives a factory that quantizes a weight into its on-disk tensors (the names
and dtypes a checkpoint holds under one layer's prefix) and the float weight those
tensors stand for; the kit builds tokenmill's :class:`~tokenmill.layers.Linear` with the
method the registered config picks for it, loads the tensors through the layer's weight
loaders (as a model's ``load_weights`` does), runs ``process_weights_after_loading``, and
compares the layer's output with ``x @ dequantized.T + bias``::

    class TestMyQuant(QuantizationConformance):
        method = "my-quant"                       # registered name or checkpoint alias
        quantization_config = {"quant_method": "my-quant", "bits": 4}
        relative_tolerance = 1e-5                 # weight-only: float accumulation order only

        def make_weights(self, out_features, in_features, seed):
            weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
            packed, scales = my_quantizer(weight)
            return QuantizedWeights({"qweight": packed, "scales": scales}, my_dequantize(packed, scales))

The error is measured as ``||y - y_ref|| / ||y_ref||`` over the whole output: a method
that rounds the activations too (FP8, INT8 W8A8) sets the bound its rounding allows.
A merged layer (q/k/v-like output shards, each quantized on its own and loaded with its
``shard_id``) is checked too unless ``merged_shards`` is None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.linear import Linear, load_weight, process_weights_after_loading
from tokenmill.layers.quantization import QuantizationConfig
from tokenmill.plugins.specs import QuantMethodSpec, resolve_qualname
from tokenmill.testing.kit_base import KitTestClass

LAYER_PREFIX = "model.layers.0.mlp.down_proj"


@dataclass
class QuantizedWeights:
    """One layer's (or one output shard's) checkpoint tensors and the float weight they hold."""

    tensors: Mapping[str, torch.Tensor]  # loaded in this order (a format may need its type first)
    dequantized: torch.Tensor  # [out, in]


def random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A float32 ``[out, in]`` weight with a linear layer's usual spread (std ``in ** -0.5``)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator) * in_features ** -0.5


def registered_quant_spec(name: str, platform: Any = None) -> QuantMethodSpec | None:
    """The installed method called ``name``, or whose checkpoint aliases hold it."""
    from tokenmill.plugins import get_plugin_manager

    named = get_plugin_manager().collect_named("tokenmill_register_quantization_methods", platform=platform)
    for _, spec in named.values():
        if name.casefold() in {n.casefold() for n in (spec.name, *spec.checkpoint_aliases)}:
            return spec
    return None


class QuantizationConformance(KitTestClass):
    """Base of a quantization method's conformance tests (not collected itself)."""

    method: ClassVar[str]
    quantization_config: ClassVar[Mapping[str, Any]] = {}
    # (in_features, out_features): small, and a multiple of the usual group and block sizes (32)
    shapes: ClassVar[tuple[tuple[int, int], ...]] = ((64, 96), (128, 32))
    merged_shards: ClassVar[tuple[int, ...] | None] = (64, 32, 32)
    activation_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    bias: ClassVar[bool] = True
    relative_tolerance: ClassVar[float] = 1e-5
    device: ClassVar[str] = "cpu"
    tokens: ClassVar[int] = 7

    def make_weights(self, out_features: int, in_features: int, seed: int) -> QuantizedWeights:
        """The plugin's factory: a random weight quantized into the on-disk tensors of a
        layer of this shape, and their dequantised ``[out_features, in_features]`` weight."""
        raise NotImplementedError(f"{type(self).__name__} must define make_weights")

    @classmethod
    def tokenmill_kit_parameters(cls, full: bool) -> list[tuple[str, list[Any], list[str]]]:
        return [("linear_shape", list(cls.shapes), [f"{i}x{o}" for i, o in cls.shapes]),
                ("activation_dtype", list(cls.activation_dtypes), list(cls.activation_dtypes))]

    def make_config(self) -> QuantizationConfig:
        spec = registered_quant_spec(self.method)
        if spec is None:
            pytest.fail(f"no installed plugin registers the quantization method {self.method!r}")
        config_cls = resolve_qualname(spec.qualname)
        assert isinstance(config_cls, type) and issubclass(config_cls, QuantizationConfig), \
            f"{spec.qualname} is not a QuantizationConfig subclass"
        return config_cls.from_config(dict(self.quantization_config))

    def build_layer(self, in_features: int, shards: list[QuantizedWeights], dtype: torch.dtype,
                    bias: torch.Tensor | None) -> Linear:
        """A Linear with the config's method for it, loaded as a checkpoint loads it."""
        sizes = [part.dequantized.shape[0] for part in shards]
        ctx = ModelBuildContext(hf_config=None, quant_config=self.make_config(), prefix=LAYER_PREFIX,
                                params_dtype=dtype)
        with torch.device(self.device):
            layer = Linear(in_features, sum(sizes), bias=bias is not None, ctx=ctx,
                           output_partition_sizes=sizes if len(sizes) > 1 else None)
        assert layer.quant_method.__class__.__name__ != "UnquantizedLinearMethod", \
            f"the {self.method} config left {LAYER_PREFIX} float"
        params = dict(layer.named_parameters())
        for shard_id, part in enumerate(shards):
            for name, tensor in part.tensors.items():
                if name not in params:
                    pytest.fail(f"the layer's method has no parameter {name!r} for that checkpoint tensor; it has "
                                f"{sorted(params)}")
                load_weight(params[name], tensor, shard_id if len(shards) > 1 else None)
        if bias is not None:
            load_weight(params["bias"], bias.to(dtype))
        process_weights_after_loading(layer)
        return layer

    def check(self, in_features: int, out_sizes: list[int], dtype_name: str, seed: int = 0) -> None:
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        dtype = getattr(torch, dtype_name)
        generator = torch.Generator().manual_seed(seed)
        shards = [self.make_weights(out, in_features, seed + 17 * i) for i, out in enumerate(out_sizes)]
        for size, part in zip(out_sizes, shards, strict=True):
            assert tuple(part.dequantized.shape) == (size, in_features), \
                f"make_weights gave a dequantised weight of shape {tuple(part.dequantized.shape)}"
        bias = torch.randn(sum(out_sizes), generator=generator) if self.bias else None
        layer = self.build_layer(in_features, shards, dtype, bias)
        x = torch.randn(self.tokens, in_features, generator=generator).to(dtype)
        out = layer(x.to(device))
        assert out.shape == (self.tokens, sum(out_sizes)) and out.dtype == dtype, \
            f"output {tuple(out.shape)} {out.dtype}, expected {(self.tokens, sum(out_sizes))} {dtype}"
        weight = torch.cat([part.dequantized.double() for part in shards])
        expected = x.double() @ weight.t() + (bias.to(dtype).double() if bias is not None else 0)
        error = float((out.double().cpu() - expected).norm() / expected.norm())
        # the reference's own rounding of x and the output to the activation dtype
        allowed = self.relative_tolerance + (0 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps)
        assert error <= allowed, f"relative error {error:.3g} against the dequantised weight exceeds {allowed:.3g}"

    def test_linear_matches_dequantized_weight(self, linear_shape: tuple[int, int], activation_dtype: str) -> None:
        in_features, out_features = linear_shape
        self.check(in_features, [out_features], activation_dtype)

    def test_merged_layer_loads_shard_by_shard(self, activation_dtype: str) -> None:
        if self.merged_shards is None:
            pytest.skip("the class declares no merged layers (merged_shards = None)")
        self.check(self.shapes[0][0], list(self.merged_shards), activation_dtype, seed=3)
