"""The ``awq`` quantization config, read from a checkpoint's ``quantization_config``.

Fields (AutoAWQ's names): ``bits`` (4: the GEMM layout packs eight values a word),
``group_size`` (input channels sharing a scale and zero; they must divide the
input), ``zero_point`` (true: the GEMM layout always stores zeros),
``version`` (``"gemm"``; GEMV, Marlin and the exllama repackings are other layouts
and are refused by name) and ``modules_to_not_convert`` (module names left float,
matched as substrings of a layer's prefix, as AutoAWQ does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from torch import nn

from tokenmill.layers import QuantizationConfig
from tokenmill_quant_awq.method import AwqLinearMethod
from tokenmill_quant_awq.moe import AwqFusedMoEMethod

SUPPORTED_VERSIONS = ("gemm",)


@dataclass(frozen=True)
class AwqConfig(QuantizationConfig):
    name: ClassVar[str] = "awq"

    group_size: int
    not_converted: Sequence[str] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        if "quant_method" not in config:
            raise ValueError("quantization='awq' needs an AWQ checkpoint (its quantization_config): tokenmill does "
                             "not run the AWQ algorithm on a float checkpoint")
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"awq checkpoint with bits={bits!r}: the GEMM layout is 4-bit only")
        version = str(config.get("version", "gemm")).lower()
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"awq checkpoint version {version!r}: supported is {', '.join(SUPPORTED_VERSIONS)}")
        if not config.get("zero_point", True):
            raise ValueError("awq checkpoint with zero_point=false: the GEMM layout stores zeros")
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise ValueError(f"awq checkpoint with group_size={group_size!r}: expected a positive integer or -1")
        return cls(group_size=group_size, not_converted=tuple(config.get("modules_to_not_convert") or ()))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> AwqLinearMethod | None:
        if prefix.split(".")[-1] == "lm_head" or any(name in prefix for name in self.not_converted):
            return None
        return AwqLinearMethod(self.group_size)

    def get_moe_method(self, layer: nn.Module, prefix: str) -> AwqFusedMoEMethod | None:
        """A MoE layer's experts AWQ-packed, per expert (:mod:`tokenmill_quant_awq.moe`),
        unless ``modules_to_not_convert`` names the layer."""
        if any(name in prefix for name in self.not_converted):
            return None
        return AwqFusedMoEMethod(self.group_size)
