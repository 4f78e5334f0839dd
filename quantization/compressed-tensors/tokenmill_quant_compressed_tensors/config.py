"""The ``compressed-tensors`` quantization config: the package parses it, each layer gets its group's kernels.

The ``quantization_config`` is validated by ``compressed_tensors``' own
``QuantizationConfig`` (a pydantic model: config groups of targets and
quantization arguments, a global ``format`` or one per group, an ``ignore``
list). Each group's scheme is checked and mapped to a method when the config is
read (:mod:`.schemes`), so a scheme no kernel runs fails before any weight loads.
A linear layer takes the method of the first group whose targets match it (module
names, ``re:`` regular expressions, or the class name ``Linear``) unless ``ignore``
names it, matched by the package's ``is_match``. tokenmill's merged layers
(``qkv_proj``, ``gate_up_proj``) match through the names of the projections they
hold, which must then all fall in one group.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from compressed_tensors.quantization import QuantizationConfig as CompressedTensorsFormat
from compressed_tensors.utils import is_match
from torch import nn

from tokenmill.layers import FusedMoEMethod, LinearMethod, QuantizationConfig
from tokenmill_quant_compressed_tensors.schemes import (
    MethodFactory,
    MoEMethodFactory,
    method_for_scheme,
    moe_method_for_scheme,
)

# tokenmill's merged layers and the checkpoint projections each holds (matched by name suffix)
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class CompressedTensorsConfig(QuantizationConfig):
    name: ClassVar[str] = "compressed-tensors"

    def __init__(self, groups: list[tuple[str, list[str], MethodFactory]], ignore: list[str],
                 moe_groups: dict[str, MoEMethodFactory] | None = None) -> None:
        self.groups = groups
        self.ignore = ignore
        self.moe_groups = moe_groups or {}  # each group's MoE method factory

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        if "quant_method" not in config:
            raise ValueError("quantization='compressed-tensors' needs a compressed-tensors checkpoint (its "
                             "quantization_config); for online quantization ask for 'int8' or 'fp8'")
        parsed = CompressedTensorsFormat.model_validate(config)
        if parsed.quantization_status != "compressed":
            raise ValueError(f"compressed-tensors checkpoint with quantization_status "
                             f"{parsed.quantization_status.value!r}: only 'compressed' weights are read")
        if parsed.kv_cache_scheme is not None:
            raise ValueError("compressed-tensors checkpoint with a kv_cache_scheme: quantized KV caches are not "
                             "supported by this method")
        groups = []
        for name, scheme in parsed.config_groups.items():
            if isinstance(scheme, list):
                raise ValueError(f"compressed-tensors config group {name!r} names a preset scheme {scheme}; "
                                 "a compressed checkpoint spells its schemes out")
            groups.append((name, list(scheme.targets), method_for_scheme(name, scheme, scheme.format or parsed.format)))
        moe_groups = {name: moe_method_for_scheme(name, scheme, scheme.format or parsed.format)
                      for name, scheme in parsed.config_groups.items() if not isinstance(scheme, list)}
        return cls(groups, list(parsed.ignore or ()), moe_groups)

    def group_of(self, layer: nn.Module, prefix: str) -> tuple[str, MethodFactory] | None:
        """The group (name, method factory) of the layer at ``prefix``; None: it stays float."""
        owner, _, leaf = prefix.rpartition(".")
        names = [f"{owner}.{shard}" if owner else shard for shard in FUSED[leaf]] if leaf in FUSED else [prefix]
        found = [self._first_match(layer, name) for name in names]
        if any(match != found[0] for match in found):
            chosen = ", ".join(f"{name}: {'float' if g is None else g[0]}" for name, g in zip(names, found, strict=True))
            raise ValueError(f"{prefix}: its projections fall in different compressed-tensors groups ({chosen}); "
                             "a merged layer runs one scheme")
        return found[0]

    def _first_match(self, layer: nn.Module, name: str) -> tuple[str, MethodFactory] | None:
        for group, targets, factory in self.groups:
            if is_match(name, layer, targets, ignore=self.ignore):
                return group, factory
        return None

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        found = self.group_of(layer, prefix)
        return None if found is None else found[1](layer, prefix)

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod | None:
        """The experts follow the group of their first expert's gate projection: the checkpoint
        (and the tool that quantized it) sees each expert's projections as ``Linear`` layers."""
        names = getattr(layer, "expert_names", ("gate_proj", "up_proj", "down_proj"))
        found = self._first_match(nn.Linear(1, 1, bias=False, device="meta"), f"{prefix}.0.{names[0]}")
        return None if found is None else self.moe_groups[found[0]](layer, prefix)
