"""A worker: one rank's model runner, built from a :class:`WorkerSpec`.

It does everything one worker process does before its first step (load its own
checkpoint, choose the model class and attention backend, build the model, make
the runner), then answers the executor's ``collective_rpc`` calls: its public
methods are what an executor may call by name on every worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from tokenmill.attention import AttentionRequirements, create_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.eplb.rebalance import expert_rebalancer
from tokenmill.kv_cache.fp8 import kv_cache_torch_dtype
from tokenmill.kv_transfer.connector import KVConnectorContext
from tokenmill.kv_transfer.registry import build_worker_connector
from tokenmill.layers.attention import Attention
from tokenmill.layers.communicator import SINGLE_RANK, Communicator
from tokenmill.layers.pipeline import SINGLE_STAGE, PipelineStage
from tokenmill.lora.model_slots import LoRAModelSlots
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.loader import load_checkpoint, resolve_model_class
from tokenmill.model_loader.quant_config import resolve_quant_config
from tokenmill.platform import (
    ActivationProfiling,
    Platform,
    detect_platform,
    platform_kv_allocator,
    platform_kv_prefault_bytes,
    platform_step_graph_capture,
)
from tokenmill.plugins.manager import PluginManager
from tokenmill.scheduler.output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposer import ProposerContext, build_proposer
from tokenmill.worker.memory_profile import profile_forward
from tokenmill.worker.model_builder import build_model
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.parallel_groups import parallel_groups
from tokenmill.worker.spec import WorkerSpec
from tokenmill.worker.spec_decode import SpecDecodeRunner
from tokenmill.worker.step_graphs import StepGraphCapture

logger = logging.getLogger(__name__)

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
        groups = parallel_groups(spec, platform)
        self.comm = groups.tensor
        self.stage = groups.stage
        self.step_seconds = 0.0  # wall time in execute_model and sample_tokens, for communication_stats
        self.steps = 0
        self.runner = create_model_runner(spec.config, platform, self.plugins, checkpoint, dtype, spec.max_model_len,
                                          progress=progress and spec.rank == 0, samples=spec.samples,
                                          comm=groups.tensor, stage=groups.stage)
        # expert-parallel load balancing (enable_eplb): moves experts between the ranks every N steps
        self.eplb = expert_rebalancer(spec.config, cast(nn.Module, self.runner.model), groups.tensor)

    def execute_method(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        """What this worker does for one ``collective_rpc``: a public method by name, or a
        function called with the worker first."""
        if callable(method):
            return method(self, *args, **(kwargs or {}))
        if method.startswith("_") or method == "execute_method" or not callable(getattr(self, method, None)):
            raise AttributeError(f"collective_rpc: {method!r} is not a public method of {type(self).__name__}")
        return getattr(self, method)(*args, **(kwargs or {}))

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def kv_cache_budget(self) -> int:
        """Bytes this rank's KV cache may take, measured by its platform after its weights loaded
        (and, on a platform that profiles, after the largest step ran once)."""
        config = self.spec.config
        if isinstance(self.platform, ActivationProfiling) and config.kv_cache_memory is None:
            try:
                peak = self.platform.measure_peak_bytes(profile_forward(self.runner, config.max_num_batched_tokens))
            except Exception as exc:  # a model the dummy step does not fit: size without it
                logger.warning("could not profile the largest step (%s); sizing the KV cache without it", exc)
            else:
                return self.platform.kv_cache_bytes_after_profile(config, peak)
        return self.platform.kv_cache_bytes(config)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # An optional platform capability (KVCachePrefault): how much of the cache to fault in now.
        self.runner.allocate_kv_cache(num_blocks, platform_kv_prefault_bytes(self.platform, self.spec.config))

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """The step's forward; its output comes from :meth:`sample_tokens`."""
        start = time.perf_counter()
        if self.eplb is not None:  # before the forward: a rebalance lands between two steps
            self.eplb.before_step(scheduler_output.total_num_scheduled_tokens)
        self.runner.execute_model(scheduler_output)
        self.step_seconds += time.perf_counter() - start
        self.steps += 1

    def sample_tokens(self, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        """The last forward's output (empty on a rank other than 0: only rank 0 samples)."""
        start = time.perf_counter()
        try:
            return self.runner.sample_tokens(grammar)
        finally:
            self.step_seconds += time.perf_counter() - start

    def communication_stats(self) -> dict[str, float]:
        """Cumulative since start-up: seconds this rank spent in its tensor-parallel group's
        collectives (all-reduce, all-gather, gather, broadcast) and how many ran, and the
        seconds and count of its steps (forward and sampling), which contain them. A caller
        takes differences across a run; with one rank there are no collectives (zeros).
        Under pipeline parallelism, also the seconds its steps spent blocked on the other
        stages (receiving hidden states, or behind the next stage's receives): a step's time
        less those is the time this stage computed."""
        return {"comm_seconds": self.comm.time.seconds, "comm_calls": float(self.comm.time.calls),
                "step_seconds": self.step_seconds, "steps": float(self.steps),
                "stage": float(self.stage.rank), "pipeline_blocked_seconds": self.stage.comm.blocked.seconds}

    def eplb_stats(self) -> dict[str, Any] | None:
        """What expert-parallel load balancing did on this rank and the placements now (None: off)."""
        return self.eplb.stats() if self.eplb is not None else None

    def lora_targets(self) -> Any:
        """The layers LoRA adapters may target and their shapes (a ``LoRATargetTable``; None without LoRA)."""
        return self.runner.lora.targets if self.runner.lora is not None else None

    def attention_backend_name(self) -> str:
        return str(self.runner.backend.name)

    def shutdown(self) -> None:
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.shutdown()
        self.runner.free_kv_cache()


def create_model_runner(config: EngineConfig, platform: Any, plugins: PluginManager, checkpoint: Checkpoint,
                        dtype: torch.dtype, max_model_len: int, progress: bool = False,
                        samples: bool = True, comm: Communicator = SINGLE_RANK,
                        stage: PipelineStage = SINGLE_STAGE) -> ModelRunner:
    model_cls = resolve_model_class(checkpoint, plugins, platform)
    device = platform.device()
    quant_config = resolve_quant_config(checkpoint, plugins, platform, config.quantization)
    model = build_model(model_cls, checkpoint, device, dtype, progress=progress, quant_config=quant_config, comm=comm,
                        stage=stage, expert_parallel=config.enable_expert_parallel,
                        redundant_experts=config.eplb_config.num_redundant_experts if config.enable_eplb else None)
    # the layers the backend serves (a latent layer, tokenmill.attention.kv_spec, reads its own cache)
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.kv_cache_spec.kind == "kv"]
    needs = AttentionRequirements(
        device_type=platform.device_type,
        dtype=str(dtype).removeprefix("torch."),
        head_size=layers[0].head_size if layers else 0,
        sliding_window=any(layer.sliding_window for layer in layers),
        preferred=config.attention_backend,
        logits_soft_cap=any(layer.logits_soft_cap for layer in layers),
        block_size=config.block_size,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    backend = create_attention_backend(plugins, platform, needs, block_size=config.block_size,
                                       kv_cache_dtype=config.kv_cache_dtype)
    lora = LoRAModelSlots(cast(nn.Module, model), config.max_loras, config.max_lora_rank) if config.enable_lora else None
    runner = ModelRunner(
        model=model,
        backend=backend,
        device=device,
        dtype=dtype,
        vocab_size=checkpoint.text_config.vocab_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        block_size=config.block_size,
        kv_allocator=platform_kv_allocator(platform),
        graph_capture=_graph_capture(config, platform, backend, comm, stage),
        max_graph_batch_size=config.max_graph_batch_size,
        samples=samples,
        mirrors_logits=comm.world_size > 1 and stage.is_last,  # only the last stage has an lm_head
        lora=lora,
        mm_encoder_cache_size=config.mm_encoder_cache_size,
        kv_cache_dtype=kv_cache_torch_dtype(config.kv_cache_dtype, dtype),
    )
    if config.speculative_config is not None and samples:
        runner.spec_decode = _spec_decode_runner(config, plugins, platform, runner, max_model_len)
        if runner.spec_decode.target_layer_ids:  # EAGLE-3: the target records those layers' states
            runner.record_aux_hidden_states(runner.spec_decode.target_layer_ids)
    if config.kv_transfer_config is not None:
        context = KVConnectorContext(config.kv_transfer_config, config, config.block_size, rank=comm.rank,
                                     device=device, dtype=dtype)
        runner.bind_kv_connector(build_worker_connector(plugins, context))
    return runner


def _spec_decode_runner(config: EngineConfig, plugins: PluginManager, platform: Any, runner: ModelRunner,
                        max_model_len: int) -> SpecDecodeRunner:
    """The proposer ``config.speculative_config`` names, built in the worker that samples."""
    speculative = cast(SpeculativeConfig, config.speculative_config)
    context = ProposerContext(engine_config=config, vocab_size=runner.vocab_size, max_model_len=max_model_len, device=runner.device,
                              dtype=runner.dtype, plugins=plugins, platform=platform,
                              max_num_seqs=runner.batch.max_num_reqs, block_size=runner.block_size,
                              target_model=runner.model)
    return SpecDecodeRunner(build_proposer(speculative, plugins, context), speculative.num_speculative_tokens)


def _graph_capture(config: EngineConfig, platform: Any, backend: Any, comm: Communicator,
                   stage: PipelineStage = SINGLE_STAGE) -> StepGraphCapture | None:
    """The platform, if decode steps may run through its step graphs. Not under tensor or
    pipeline parallelism: a step graph records kernel calls, and a gloo collective is not one. With
    LoRA where every wrapped layer has the platform's LoRA kernel (the runner asks the slots:
    tokenmill.lora.model_slots.LoRAModelSlots.enable_step_graphs)."""
    if (config.enforce_eager or comm.world_size > 1 or stage.size > 1
            or config.kv_transfer_config is not None  # a step graph would skip the connector's per-layer calls
            or not getattr(backend, "supports_step_graphs", False)):
        return None
    return platform_step_graph_capture(platform)
