"""The ``gptq`` quantization config, read from a checkpoint's ``quantization_config``.

Fields (AutoGPTQ's and GPTQModel's names): ``bits`` (2, 4 or 8), ``group_size``
(input channels that share a scale and zero; -1: one group over the whole input),
``desc_act`` (act-order: the groups follow a permutation of the input channels,
given per layer by ``g_idx``), ``sym`` (symmetric: every zero is ``2**(bits-1)``;
the checkpoint stores the zeros either way, and they are read, not assumed),
``checkpoint_format`` (``"gptq"``, v1: each stored zero is one less than the real
one, AutoGPTQ's long-standing convention; ``"gptq_v2"``: stored as is) and
``lm_head`` (whether the lm_head is quantized too). GPTQModel's per-module
``dynamic`` overrides are refused by name rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from torch import nn

from tokenmill.layers import QuantizationConfig
from tokenmill_quant_gptq.kernels import SUPPORTED_BITS
from tokenmill_quant_gptq.method import GptqLinearMethod, GptqScheme
from tokenmill_quant_gptq.moe import GptqFusedMoEMethod

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 2}


@dataclass(frozen=True)
class GptqConfig(QuantizationConfig):
    name: ClassVar[str] = "gptq"

    scheme: GptqScheme
    lm_head: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        if "quant_method" not in config:
            raise ValueError("quantization='gptq' needs a GPTQ checkpoint (its quantization_config): tokenmill does "
                             "not run the GPTQ algorithm on a float checkpoint")
        return cls(scheme=scheme_from_config(config), lm_head=bool(config.get("lm_head", False)))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> GptqLinearMethod | None:
        if prefix.split(".")[-1] == "lm_head" and not self.lm_head:
            return None
        return GptqLinearMethod(self.scheme)

    def get_moe_method(self, layer: nn.Module, prefix: str) -> GptqFusedMoEMethod:
        """Every MoE layer's experts are GPTQ-packed, per expert (:mod:`tokenmill_quant_gptq.moe`)."""
        return GptqFusedMoEMethod(self.scheme)


def scheme_from_config(config: dict[str, Any]) -> GptqScheme:
    """The checked fields of a GPTQ ``quantization_config``, each refused by name when unsupported."""
    bits = config.get("bits", 4)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"gptq checkpoint with bits={bits!r}: supported are {', '.join(map(str, SUPPORTED_BITS))}")
    group_size = config.get("group_size", 128)
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"gptq checkpoint with group_size={group_size!r}: expected a positive integer or -1")
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if fmt not in CHECKPOINT_FORMATS:
        raise ValueError(f"gptq checkpoint_format {fmt!r}: supported are {', '.join(CHECKPOINT_FORMATS)}")
    if config.get("dynamic"):
        raise ValueError("gptq checkpoint with per-module 'dynamic' overrides: not supported")
    return GptqScheme(bits=bits, group_size=group_size, desc_act=bool(config.get("desc_act", False)),
                      sym=bool(config.get("sym", True)), zero_version=CHECKPOINT_FORMATS[fmt])
