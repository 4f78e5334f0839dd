"""Which kernels run a compressed-tensors config group: each scheme checked and handed to a method.

* int weights and int input activations: INT8 W8A8 (``format: "int-quantized"``),
  handed to the installed ``int8`` method: its config is built from this group
  (it checks the fields itself: 8-bit symmetric per-channel weights; activations
  dynamic per token or static per tensor with an ``input_scale``, symmetric or with
  zero points) and gives each layer its method;
* float weights and float activations: FP8 (``"float-quantized"``, float8_e4m3fn
  weights per tensor or per channel; activations dynamic per token, or static per
  tensor with an ``input_scale``), handed to the installed ``fp8`` method, whose
  parameters are the ones compressed-tensors writes;
* int weights and no input activations: W4A16 / W8A16 (``"pack-quantized"``, per
  group or per channel, symmetric or with zero points), this plugin's
  :class:`~tokenmill_quant_compressed_tensors.packed.PackedIntLinearMethod`.

The other methods are found by name among the installed plugins' registered
quantization methods (their public config classes), never imported. Anything
else is refused, naming the group, the field and what would run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from torch import nn

from tokenmill.layers import SUPPORTED_BITS, FusedMoEMethod, LinearMethod, QuantizationConfig
from tokenmill.plugin_api import get_plugin_manager, resolve_qualname
from tokenmill_quant_compressed_tensors.packed import PackedIntLinearMethod

MethodFactory = Callable[[nn.Module, str], LinearMethod | None]
MoEMethodFactory = Callable[[nn.Module, str], FusedMoEMethod | None]
SUPPORTED = ("INT8 W8A8 (int-quantized, by the int8 method)",
             "FP8 weights and activations (float-quantized, by the fp8 method)",
             "int weights with float activations, W4A16/W8A16 (pack-quantized)")


def method_for_scheme(group: str, scheme: QuantizationScheme, fmt: str) -> MethodFactory:
    """The method factory (``factory(layer, prefix)``) for config group ``group``, checked now, at load."""
    weights, inputs = scheme.weights, scheme.input_activations
    if weights is None:
        raise _refuse(group, "has no weights quantization")
    if scheme.output_activations is not None:
        raise _refuse(group, "quantizes output activations")
    if weights.type == "int" and inputs is not None and inputs.type == "int":
        int8 = installed_method_config("int8", group, {"quant_method": "compressed-tensors", "format": fmt,
                                                       "config_groups": {group: scheme.model_dump(mode="json")}})
        return int8.get_linear_method
    if weights.type == "float" and inputs is not None and inputs.type == "float":
        return _fp8(group, weights, inputs, fmt).get_linear_method
    if weights.type == "int" and inputs is None:
        method = _packed_int(group, weights, fmt)
        return lambda layer, prefix: method()
    described = f"{weights.type} weights and " + ("no input_activations" if inputs is None
                                                  else f"{inputs.type} input_activations")
    raise _refuse(group, f"has {described}")


def installed_method_config(name: str, group: str, config: dict[str, Any]) -> QuantizationConfig:
    """The config of the installed quantization method ``name``, built from ``config``."""
    registered = get_plugin_manager().collect_named("tokenmill_register_quantization_methods", platform=None)
    specs = [spec for _, spec in registered.values()]
    spec = next((spec for spec in specs if spec.name == name), None)
    if spec is None:
        raise ValueError(f"compressed-tensors config group {group!r} is run by the {name!r} quantization method, "
                         f"which is not installed (installed: {', '.join(sorted(s.name for s in specs))})")
    config_cls = resolve_qualname(spec.qualname)
    return config_cls.from_config(config)  # type: ignore[no-any-return]


def _fp8(group: str, weights: QuantizationArgs, inputs: QuantizationArgs, fmt: str) -> QuantizationConfig:
    if fmt != "float-quantized":
        raise _refuse(group, f"has FP8 weights in format {fmt!r}; the fp8 kernels read 'float-quantized'")
    _expect(group, "weights", weights, num_bits=8, symmetric=True, dynamic=False)
    _expect(group, "input_activations", inputs, num_bits=8, symmetric=True)
    if weights.strategy not in ("tensor", "channel"):
        raise _refuse(group, f"weights.strategy is {weights.strategy!r}; the fp8 kernels take 'tensor' or 'channel'")
    if inputs.dynamic is True and inputs.strategy == "token":
        scheme = "dynamic"
    elif inputs.dynamic is False and inputs.strategy == "tensor":
        scheme = "static"
    else:
        raise _refuse(group, f"input_activations are {'dynamic' if inputs.dynamic else 'static'} per "
                             f"{inputs.strategy}; the fp8 kernels take dynamic per token or static per tensor")
    return installed_method_config("fp8", group, {"quant_method": "fp8", "activation_scheme": scheme})


def _packed_int(group: str, weights: QuantizationArgs, fmt: str) -> Callable[[], PackedIntLinearMethod]:
    if fmt != "pack-quantized":
        raise _refuse(group, f"has no input_activations (int weights only) in format {fmt!r}; weight-only int "
                             "schemes are read in 'pack-quantized'")
    if weights.num_bits not in SUPPORTED_BITS:
        raise _refuse(group, f"weights.num_bits is {weights.num_bits}; the packed int kernels take "
                             f"{', '.join(map(str, SUPPORTED_BITS))}")
    if weights.strategy not in ("group", "channel"):
        raise _refuse(group, f"weights.strategy is {weights.strategy!r}; the packed int kernels take 'group' or "
                             "'channel'")
    if weights.actorder in ("group", "dynamic"):
        raise _refuse(group, f"weights.actorder is {weights.actorder!r} (a weight_g_idx per layer): not supported yet")
    group_size = weights.group_size if weights.strategy == "group" else None
    return functools.partial(PackedIntLinearMethod, weights.num_bits, group_size, weights.symmetric)


def _expect(group: str, field: str, args: QuantizationArgs, **expected: Any) -> None:
    for key, value in expected.items():
        if getattr(args, key) != value:
            raise _refuse(group, f"{field}.{key} is {getattr(args, key)!r}; the kernels for this scheme take {value!r}")


def _refuse(group: str, what: str) -> ValueError:
    return ValueError(f"compressed-tensors config group {group!r} {what}. Schemes that run: {'; '.join(SUPPORTED)}")


def moe_method_for_scheme(group: str, scheme: QuantizationScheme, fmt: str) -> MoEMethodFactory:
    """The MoE counterpart of :func:`method_for_scheme`: FP8 experts go to the installed
    ``fp8`` method's serialized experts; the others are refused, when a MoE layer falls in
    ``group``, naming the group (their experts are not read yet)."""
    weights, inputs = scheme.weights, scheme.input_activations
    if weights is not None and weights.type == "float" and inputs is not None and inputs.type == "float":
        return _fp8(group, weights, inputs, fmt).get_moe_method

    def refuse(layer: nn.Module, prefix: str) -> None:
        raise _refuse(group, f"covers the MoE layer {prefix}, whose experts are read only for FP8 schemes so far")

    return refuse
