"""The ``int8`` (W8A8) quantization config, read from a compressed-tensors ``quantization_config``.

A compressed-tensors config (``quant_method: "compressed-tensors"``) lists
``config_groups``, each with ``targets`` and the ``weights`` / ``input_activations``
quantization arguments, a ``format`` and an ``ignore`` list (module names, or
``re:``-prefixed regular expressions). This method takes the INT8 W8A8 schemes:
one group targeting ``Linear``, ``format: "int-quantized"``, 8-bit symmetric int
weights per channel (static) and 8-bit int activations, symmetric or asymmetric,
dynamic per token or static per tensor (``input_scale``, and ``input_zero_point``
when asymmetric: :mod:`tokenmill_quant_int8.activations`). Anything else
(asymmetric or grouped weights, other bit widths, grouped or per-channel
activations) is refused by name, so a checkpoint never runs with a scheme that is
not the one it was quantized with. ``quant_method: "int8_w8a8"``
takes the same fields. No ``quantization_config`` (``LLM(..., quantization="int8")``
on a float checkpoint): every linear layer but the lm_head is quantized at load, and every
MoE layer's experts per expert and channel (:mod:`tokenmill_quant_int8.moe`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from torch import nn

from tokenmill.layers import QuantizationConfig
from tokenmill_quant_int8.activations import ActivationScheme, activation_scheme
from tokenmill_quant_int8.method import Int8OnlineLinearMethod, Int8W8A8LinearMethod
from tokenmill_quant_int8.moe import Int8OnlineMoEMethod

SUPPORTED_FORMAT = "int-quantized"
WEIGHTS = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}


class Int8W8A8Config(QuantizationConfig):
    name: ClassVar[str] = "int8"

    def __init__(self, serialized: bool, ignore: Sequence[str] = (), activations: ActivationScheme | None = None) -> None:
        self.serialized = serialized
        self.ignore = tuple(ignore)
        self.activations = activations or ActivationScheme()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        if "quant_method" not in config:
            return cls(serialized=False)
        return cls(serialized=True, ignore=config.get("ignore") or (), activations=check_w8a8_scheme(config))

    def is_ignored(self, prefix: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], prefix):
                    return True
            elif prefix == entry or prefix.startswith(entry + "."):
                return True
        return False

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Int8W8A8LinearMethod | None:
        if not self.serialized:
            # The logits are where rounding shows most and the lm_head is one layer of many: keep it float.
            return None if prefix.split(".")[-1] == "lm_head" else Int8OnlineLinearMethod()
        return None if self.is_ignored(prefix) else Int8W8A8LinearMethod(self.activations)

    def get_moe_method(self, layer: nn.Module, prefix: str) -> Int8OnlineMoEMethod | None:
        """Online: every expert quantized per channel. A serialized checkpoint's INT8 experts
        are not read yet (refused by name, rather than loaded as if float)."""
        if not self.serialized:
            return Int8OnlineMoEMethod()
        if self.is_ignored(prefix):
            return None
        raise ValueError(f"int8: the checkpoint's INT8 experts ({prefix}) are not supported yet; "
                         "quantize a float checkpoint at load instead (quantization='int8')")


def check_w8a8_scheme(config: dict[str, Any]) -> ActivationScheme:
    """The activation scheme of a compressed-tensors INT8 W8A8 config; any other config is
    refused, naming the field."""
    method = config.get("quant_method")
    fmt = config.get("format", SUPPORTED_FORMAT)
    if fmt != SUPPORTED_FORMAT:
        raise ValueError(f"{method} checkpoint in format {fmt!r}: the int8 W8A8 method reads {SUPPORTED_FORMAT!r} only")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{method} checkpoint with {len(groups)} config groups: the int8 W8A8 method takes exactly one")
    (group_name, group), = groups.items()
    if "Linear" not in (group.get("targets") or ()):
        raise ValueError(f"{method} config group {group_name!r} targets {group.get('targets')}, not Linear layers")
    for field in ("weights", "input_activations"):
        if group.get(field) is None:
            raise ValueError(f"{method} config group {group_name!r} has no {field}: not a W8A8 scheme")
    weights = group["weights"]
    for key, value in WEIGHTS.items():
        if weights.get(key) != value:
            raise ValueError(f"{method} config group {group_name!r}: weights.{key} is {weights.get(key)!r}; the "
                             f"int8 W8A8 method takes {value!r} ({', '.join(f'{k}={v}' for k, v in WEIGHTS.items())})")
    if weights.get("group_size") is not None:
        raise ValueError(f"{method} config group {group_name!r}: weights.group_size {weights['group_size']} "
                         "(grouped int8 is not this method)")
    return activation_scheme(f"{method} config group {group_name!r}: input_activations", group["input_activations"])
