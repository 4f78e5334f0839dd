"""Everything one worker process does before its first step: choose the
model class and attention backend, build the model, make the runner."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention import AttentionRequirements, create_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.layers.attention import Attention
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.loader import resolve_model_class
from tokenmill.model_loader.quant_config import resolve_quant_config
from tokenmill.platform import platform_kv_allocator, platform_step_graph_capture
from tokenmill.plugins.manager import PluginManager
from tokenmill.worker.model_builder import build_model
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.step_graphs import StepGraphCapture


def create_model_runner(config: EngineConfig, platform: Any, plugins: PluginManager, checkpoint: Checkpoint,
                        dtype: torch.dtype, max_model_len: int, progress: bool = False) -> ModelRunner:
    model_cls = resolve_model_class(checkpoint, plugins, platform)
    device = platform.device()
    quant_config = resolve_quant_config(checkpoint, plugins, platform, config.quantization)
    model = build_model(model_cls, checkpoint, device, dtype, progress=progress, quant_config=quant_config)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    needs = AttentionRequirements(
        device_type=platform.device_type,
        dtype=str(dtype).removeprefix("torch."),
        head_size=layers[0].head_size if layers else 0,
        sliding_window=any(layer.sliding_window for layer in layers),
        preferred=config.attention_backend,
    )
    backend = create_attention_backend(plugins, platform, needs, block_size=config.block_size)
    return ModelRunner(
        model=model,
        backend=backend,
        device=device,
        dtype=dtype,
        vocab_size=checkpoint.hf_config.vocab_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        block_size=config.block_size,
        kv_allocator=platform_kv_allocator(platform),
        graph_capture=_graph_capture(config, platform, backend),
        max_graph_batch_size=config.max_graph_batch_size,
    )


def _graph_capture(config: EngineConfig, platform: Any, backend: Any) -> StepGraphCapture | None:
    """The platform, if decode steps may run through its step graphs."""
    if config.enforce_eager or not getattr(backend, "supports_step_graphs", False):
        return None
    return platform_step_graph_capture(platform)
