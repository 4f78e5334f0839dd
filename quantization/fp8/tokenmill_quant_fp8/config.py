"""The ``fp8`` quantization config: what a checkpoint's ``quantization_config`` says.

* ``quant_method: "fp8"`` (a serialized FP8 checkpoint): ``activation_scheme``
  ``"dynamic"`` (per-token scales computed at run time, the default) or ``"static"``
  (the checkpoint's per-tensor ``input_scale``); ``weight_block_size: [rows, cols]``
  for block-wise scales; ``ignored_layers`` (or transformers' name for it,
  ``modules_to_not_convert``): checkpoint prefixes left float.
* no ``quantization_config`` (``LLM(..., quantization="fp8")`` on a float
  checkpoint): every linear layer but the lm_head is quantized at load, per channel, and
  every MoE layer's experts per expert and channel (:mod:`tokenmill_quant_fp8.moe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Self

from torch import nn

from tokenmill.layers import QuantizationConfig
from tokenmill_quant_fp8.method import (
    Fp8BlockLinearMethod,
    Fp8LinearMethod,
    Fp8OnlineLinearMethod,
)
from tokenmill_quant_fp8.moe import Fp8OnlineMoEMethod, Fp8SerializedMoEMethod

ACTIVATION_SCHEMES = ("dynamic", "static")


class Fp8Config(QuantizationConfig):
    name: ClassVar[str] = "fp8"

    def __init__(self, serialized: bool, activation_scheme: str = "dynamic", ignored_layers: Sequence[str] = (),
                 weight_block_size: Sequence[int] | None = None) -> None:
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8: activation_scheme {activation_scheme!r} is not one of {', '.join(ACTIVATION_SCHEMES)}")
        if weight_block_size is not None:
            if len(weight_block_size) != 2 or not all(isinstance(n, int) and n > 0 for n in weight_block_size):
                raise ValueError(f"fp8: weight_block_size must be two positive integers, not {weight_block_size!r}")
            if activation_scheme != "dynamic":
                raise ValueError("fp8: block-wise weights (weight_block_size) need activation_scheme 'dynamic'")
        self.serialized = serialized
        self.activation_scheme = activation_scheme
        self.ignored_layers = tuple(ignored_layers)
        self.weight_block_size = None if weight_block_size is None else (weight_block_size[0], weight_block_size[1])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        if "quant_method" not in config:
            return cls(serialized=False)
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
        return cls(serialized=True, activation_scheme=config.get("activation_scheme", "dynamic"),
                   ignored_layers=ignored, weight_block_size=config.get("weight_block_size"))

    def is_ignored(self, prefix: str) -> bool:
        return any(prefix == ignored or prefix.startswith(ignored + ".") for ignored in self.ignored_layers)

    def get_linear_method(self, layer: nn.Module, prefix: str
                          ) -> Fp8LinearMethod | Fp8BlockLinearMethod | Fp8OnlineLinearMethod | None:
        if not self.serialized:
            # The logits are where rounding shows most and the lm_head is one layer of many: keep it float.
            return None if prefix.split(".")[-1] == "lm_head" else Fp8OnlineLinearMethod()
        if self.is_ignored(prefix):
            return None
        if self.weight_block_size is not None:
            return Fp8BlockLinearMethod(self.weight_block_size)
        return Fp8LinearMethod(static_input=self.activation_scheme == "static")

    def get_moe_method(self, layer: nn.Module, prefix: str) -> Fp8OnlineMoEMethod | Fp8SerializedMoEMethod | None:
        """Online: every expert quantized per channel. Serialized: the checkpoint's FP8
        experts with per-tensor or per-channel scales and dynamic activations; block-wise or
        static-activation experts are refused by name rather than loaded as if float."""
        if not self.serialized:
            return Fp8OnlineMoEMethod()
        if self.is_ignored(prefix):
            return None
        if self.weight_block_size is not None or self.activation_scheme != "dynamic":
            what = "block-wise (weight_block_size)" if self.weight_block_size is not None else "static-activation"
            raise ValueError(f"fp8: the checkpoint's {what} FP8 experts ({prefix}) are not supported yet")
        return Fp8SerializedMoEMethod()
