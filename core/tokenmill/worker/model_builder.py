"""Building a model from a checkpoint on the chosen device and dtype."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import cast

import torch

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.communicator import SINGLE_RANK, Communicator
from tokenmill.layers.linear import process_weights_after_loading
from tokenmill.layers.moe import held_checkpoint_tensors
from tokenmill.layers.ops import layer_ops
from tokenmill.layers.pipeline import SINGLE_STAGE, PipelineStage
from tokenmill.layers.quantization import QuantizationConfig
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.kv_scales import KVScales
from tokenmill.worker.model_interface import CausalLM

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(model_cls: type, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                progress: bool = False, *, quant_config: QuantizationConfig | None = None,
                comm: Communicator = SINGLE_RANK, stage: PipelineStage = SINGLE_STAGE,
                expert_parallel: bool = False, redundant_experts: int | None = None) -> CausalLM:
    """Instantiate ``model_cls`` directly on ``device`` in ``dtype`` and load its weights.

    The model is built as ``model_cls(hf_config, ctx=ModelBuildContext(...))``
    (:class:`~tokenmill.worker.model_interface.CausalLMClass`), its linear layers
    taking their methods from ``quant_config``. Every parameter must come from the
    checkpoint: a missing one is an error, not a silently random weight. ``comm``: the
    tensor-parallel group this rank builds its share of the model for (one rank: all of it);
    ``stage``: the pipeline stage it builds the layers of (one stage: all of them);
    ``expert_parallel``: its MoE layers hold whole experts, a share of them, rather than a
    slice of every expert (the checkpoint's tensors of other ranks' experts are not read).
    ``redundant_experts`` (not None: expert-parallel load balancing): their extra slots for copies.
    """
    ctx = ModelBuildContext(hf_config=checkpoint.hf_config, quant_config=quant_config, rank=comm.rank,
                            world_size=comm.world_size, process_group=comm.group, comm=comm, params_dtype=dtype,
                            layer_ops=layer_ops(device), pipeline=stage, expert_parallel=expert_parallel,
                            redundant_experts=redundant_experts)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(checkpoint.hf_config, ctx=ctx)
    kv_scales = KVScales()
    held = held_checkpoint_tensors(model)
    weights = kv_scales.filter(checkpoint.weights() if held is None else checkpoint.weights_where(held))
    if progress:
        from tqdm import tqdm

        weights = tqdm(weights, desc="Loading weights", unit=" tensors", leave=False)
    with torch.no_grad():
        loaded = model.load_weights((name, t.to(device)) for name, t in weights)
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {checkpoint.path} lacks parameters {sorted(missing)[:8]}")
    kv_scales.apply(model)
    with torch.no_grad():
        process_weights_after_loading(model)
    return cast(CausalLM, model.eval())
