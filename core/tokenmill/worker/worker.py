"""A worker: one rank's model runner, built from a :class:`WorkerSpec`.

It does everything one worker process does before its first step (load its own
checkpoint, choose the model class and attention backend, build the model, make
the runner), then answers the executor's ``collective_rpc`` calls: its public
methods are what an executor may call by name on every worker.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention import AttentionRequirements, create_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.layers.attention import Attention
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.loader import load_checkpoint, resolve_model_class
from tokenmill.platform import Platform, detect_platform
from tokenmill.plugins.manager import PluginManager
from tokenmill.scheduler.output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.model_builder import build_model
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.spec import WorkerSpec
from tokenmill.worker.step_graphs import StepGraphCapture


class Worker:
    """One rank. A worker in a process of its own is built from the spec alone: it loads the
    engine's plugins by name, detects and configures its platform, and reads its checkpoint.
    A worker in the engine's own process may be handed what the engine has already set up:
    its ``plugins``, its ``platform`` and its ``checkpoint`` (so the file is not read twice:
    a GGUF's vocabulary takes seconds to parse); only the weights are loaded here either way."""

    def __init__(self, spec: WorkerSpec, plugins: PluginManager | None = None, platform: Platform | None = None,
                 checkpoint: Checkpoint | None = None, progress: bool = False) -> None:
        self.spec = spec
        self.plugins = plugins if plugins is not None else spec.load_plugins()
        if platform is None:
            platform = detect_platform(self.plugins)
            platform.configure_process(spec.config)
        self.platform = platform
        self.plugins.hook.tokenmill_process_start(role="worker", rank=spec.rank, config=spec.config)
        dtype = getattr(torch, spec.dtype)
        if checkpoint is None:
            checkpoint = load_checkpoint(spec.model_path, self.plugins, platform, dtype, tokenizer=spec.config.tokenizer)
        self.runner = create_model_runner(spec.config, platform, self.plugins, checkpoint, dtype, spec.max_model_len,
                                          progress=progress and spec.rank == 0, samples=spec.samples)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def kv_cache_budget(self) -> int:
        """Bytes this rank's KV cache may take, measured by its platform after its weights loaded."""
        return self.platform.kv_cache_bytes(self.spec.config)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # Optional platform method: how much of the cache to fault in now (see CpuPlatform).
        prefault = getattr(self.platform, "kv_cache_prefault_bytes", None)
        self.runner.allocate_kv_cache(num_blocks, prefault(self.spec.config) if prefault is not None else 0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """The step's forward; its output comes from :meth:`sample_tokens`."""
        self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        """The last forward's output (empty on a rank other than 0: only rank 0 samples)."""
        return self.runner.sample_tokens(grammar)

    def attention_backend_name(self) -> str:
        return str(self.runner.backend.name)

    def shutdown(self) -> None:
        self.runner.free_kv_cache()


def create_model_runner(config: EngineConfig, platform: Any, plugins: PluginManager, checkpoint: Checkpoint,
                        dtype: torch.dtype, max_model_len: int, progress: bool = False,
                        samples: bool = True) -> ModelRunner:
    model_cls = resolve_model_class(checkpoint, plugins, platform)
    device = platform.device()
    model = build_model(model_cls, checkpoint, device, dtype, progress=progress)
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
        graph_capture=_graph_capture(config, platform, backend),
        max_graph_batch_size=config.max_graph_batch_size,
        samples=samples,
    )


def _graph_capture(config: EngineConfig, platform: Any, backend: Any) -> StepGraphCapture | None:
    """The platform, if decode steps may run through its step graphs."""
    if config.enforce_eager or not getattr(backend, "supports_step_graphs", False):
        return None
    return platform if hasattr(platform, "capture_step_graph") else None
