"""What a model's constructor is told about the model it is building.

``build_model`` makes one :class:`ModelBuildContext` per model and hands it to the
model class (``Model(hf_config, *, ctx)``); each module passes ``ctx.child(name)``
to the modules it creates, so every layer knows its checkpoint prefix
(``model.layers.3.self_attn.qkv_proj``) and can ask the quantization config which
linear method it gets. The parallel fields describe the tensor-parallel group the
layers shard over (``rank`` of ``world_size``); ``comm`` runs its collectives
(a group of one: every collective is a no-op, and the layers are unsplit).
``expert_parallel``: the MoE layers place whole experts on the group's ranks instead of
splitting each expert (:mod:`tokenmill.layers.expert_parallel`).
``redundant_experts`` (not None: expert-parallel load balancing is on) gives them that many extra
slots for copies of the hottest experts (:mod:`tokenmill.layers.expert_replicas`).
``pipeline`` is the pipeline stage this rank builds (:mod:`tokenmill.layers.pipeline`: which
decoder layers, whether the embedding or the lm_head; one stage: all of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from tokenmill.layers.communicator import SINGLE_RANK, Communicator
from tokenmill.layers.ops import LayerOps, layer_ops
from tokenmill.layers.pipeline import SINGLE_STAGE, PipelineStage

if TYPE_CHECKING:
    from tokenmill.layers.linear import LinearMethod
    from tokenmill.layers.moe import FusedMoEMethod
    from tokenmill.layers.quantization import QuantizationConfig

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@dataclasses.dataclass(frozen=True)
class ModelBuildContext:
    """The build-time facts every layer of one model shares.

    ``prefix`` is the checkpoint name of the module being built ("" for the model
    itself); ``shared`` holds modules that all layers of the model use together
    (the rotary table), so that children made with :meth:`child` see the same ones.
    """

    hf_config: Any
    quant_config: QuantizationConfig | None = None
    prefix: str = ""
    rank: int = 0
    world_size: int = 1
    process_group: Any = None
    comm: Communicator = dataclasses.field(default=SINGLE_RANK, compare=False)
    params_dtype: torch.dtype = dataclasses.field(default_factory=torch.get_default_dtype)
    layer_ops: LayerOps = dataclasses.field(default_factory=lambda: layer_ops(torch.get_default_device()))
    shared: dict[Any, nn.Module] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    pipeline: PipelineStage = dataclasses.field(default=SINGLE_STAGE, compare=False)
    expert_parallel: bool = False
    redundant_experts: int | None = None

    def child(self, name: str) -> ModelBuildContext:
        """The context of submodule ``name``: ``ctx.child("layers.3")`` under prefix
        ``model`` builds ``model.layers.3``."""
        prefix = f"{self.prefix}.{name}" if self.prefix and name else self.prefix or name
        return dataclasses.replace(self, prefix=prefix)  # the same `shared` dict

    def linear_method(self, layer: nn.Module) -> LinearMethod | None:
        """The quantization config's method for ``layer`` at this prefix; None: float."""
        if self.quant_config is None:
            return None
        return self.quant_config.get_linear_method(layer, self.prefix)

    def moe_method(self, layer: nn.Module) -> FusedMoEMethod | None:
        """The quantization config's method for the MoE layer ``layer`` here; None: float."""
        if self.quant_config is None:
            return None
        return self.quant_config.get_moe_method(layer, self.prefix)

    def shared_module(self, key: Any, build: Callable[[], ModuleT]) -> ModuleT:
        """The one module under ``key`` for the whole model, built on first request."""
        if key not in self.shared:
            self.shared[key] = build()
        return cast(ModuleT, self.shared[key])  # the key fixes the type
