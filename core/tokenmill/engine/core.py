"""The engine core: the scheduler, the KV cache manager and the executor,
and one ``step()`` that moves every running request forward."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.micro_batches import MicroBatches
from tokenmill.engine.model_info import ModelInfo
from tokenmill.engine.runner import choose_runner
from tokenmill.eplb.config import check_eplb
from tokenmill.errors import ModelNotFoundError
from tokenmill.executor import Executor, create_executor
from tokenmill.executor.expert_parallel import check_expert_parallel
from tokenmill.executor.pipeline_parallel import check_pipeline_parallel
from tokenmill.executor.tensor_parallel import check_tensor_parallel
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_transfer.connector import KVConnectorContext, KVConnectorScheduler
from tokenmill.kv_transfer.registry import build_scheduler_connector, check_connector, connector_spec
from tokenmill.lora.adapter import LoRAAdapterLoader
from tokenmill.lora.manager import LoRAManager
from tokenmill.metrics.stats import SchedulerSnapshot
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.loader import default_model, load_checkpoint, registered_model_spec, resolve_model_class
from tokenmill.multimodal.loading import computes_items_whole
from tokenmill.platform import Platform, detect_platform, platform_is_thread_affine, resolve_dtype
from tokenmill.plugins.manager import PluginManager, get_plugin_manager
from tokenmill.plugins.options import plugin_option_specs, resolve_plugin_options
from tokenmill.plugins.specs import ModelSpec
from tokenmill.request import Request, RequestStatus
from tokenmill.scheduler.output import EngineCoreOutputs
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.spec_decode.cost import break_even_acceptance_rate
from tokenmill.spec_decode.proposer import check_speculative_config
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.worker.spec import WorkerSpec, loaded_plugin_names

# With nothing runnable but requests whose grammar compiles, step() waits this
# long for one to finish instead of spinning on empty steps.
_GRAMMAR_WAIT_S = 0.05
# With nothing runnable but requests whose KV is being loaded, a step that learnt of no finished
# load sleeps this long before the next, instead of spinning on empty steps.
_KV_LOAD_WAIT_S = 0.002

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None, progress: bool = False) -> None:
        self.plugins = plugins or get_plugin_manager(strict=config.strict_plugins)
        # plugin options checked against what the plugins add, defaults filled in, before any plugin reads them
        options = resolve_plugin_options(config.plugin_options, plugin_option_specs(self.plugins))
        self.config = config = config.model_copy(update={"plugin_options": options})
        self.platform: Platform = detect_platform(self.plugins)
        self.platform.configure_process(config)
        self.plugins.hook.tokenmill_process_start(role="engine", rank=0, config=config)
        self.dtype = resolve_dtype(config.dtype, self.platform)
        self.checkpoint = load_checkpoint(config.model or default_model(self.plugins), self.plugins, self.platform,
                                          self.dtype, config.revision, config.tokenizer)
        self.max_model_len = _max_model_len(config, self.checkpoint,
                                            registered_model_spec(self.checkpoint, self.plugins))
        self.runner = choose_runner(config, self.checkpoint, self.plugins)
        self.eos_token_id, self.extra_stop_token_ids = eos_token_ids(self.checkpoint.generation_config,
                                                                     self.checkpoint.tokenizer)
        check_tensor_parallel(self.checkpoint.text_config, config.tensor_parallel_size)  # before any worker starts
        check_expert_parallel(self.checkpoint.text_config, config.tensor_parallel_size, config.enable_expert_parallel)
        check_eplb(self.checkpoint.text_config, config.tensor_parallel_size, config.enable_eplb, config.eplb_config)
        if config.speculative_config is not None:  # a bad config fails the start, before any worker
            check_speculative_config(config.speculative_config, self.plugins, int(self.checkpoint.text_config.vocab_size),
                                     self.max_model_len, config.tensor_parallel_size)
        if config.kv_transfer_config is not None:  # an unknown connector fails the start, before any worker
            check_connector(connector_spec(self.plugins, config.kv_transfer_config.kv_connector), config)
        if config.pipeline_parallel_size > 1:
            check_pipeline_parallel(self.checkpoint.hf_config,
                                    resolve_model_class(self.checkpoint, self.plugins, self.platform),
                                    config.pipeline_parallel_size)
        self.worker_spec = WorkerSpec(
            model_path=str(self.checkpoint.path), config=config, dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len, plugins=loaded_plugin_names(self.plugins),
            world_size=config.world_size)
        self.executor: Executor = create_executor(self.plugins, self.worker_spec, platform=self.platform,
                                                  checkpoint=self.checkpoint, progress=progress)
        self.num_kv_blocks = self._init_kv_cache()
        # An encoder's blocks hold no KV and its requests never look a prefix up: hashing them is waste.
        self.kv_manager = KVCacheManager(self.num_kv_blocks, config.block_size,
                                         config.enable_prefix_caching and not self.runner.is_encoder)
        self._model_info = self._describe_model()
        self.structured_output = StructuredOutputManager.from_plugins(
            self.plugins, config.structured_outputs_backend, self.checkpoint.tokenizer, self._model_info.vocab_size,
            self._model_info.stop_token_ids)
        self.lora = self._lora_manager()
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            non_causal_prefill=self.runner.is_encoder,
            num_speculative_tokens=config.speculative_config.num_speculative_tokens if config.speculative_config else 0,
            **_draft_backoff_options(config.speculative_config, self.checkpoint.text_config),
            steps_in_flight=config.pipeline_parallel_size,
            max_num_encoder_input_tokens=config.max_num_encoder_input_tokens or 0,
            encoder_cache_size=config.mm_encoder_cache_size,
            whole_mm_items=computes_items_whole(self.checkpoint, self.plugins),
        ), self.kv_manager, self.structured_output, self.lora,
            self._kv_connector())
        # Pipeline stages overlap on micro-batches: a step per stage in flight (engine.micro_batches)
        self.micro_batches = (MicroBatches(config.pipeline_parallel_size, self.scheduler, self.executor)
                              if config.pipeline_parallel_size > 1 else None)
        self._building_thread = threading.get_ident()
        self._warned_thread = False

    def _kv_connector(self) -> KVConnectorScheduler | None:
        """The scheduler half of the ``kv_transfer_config`` connector, if one is configured."""
        if self.config.kv_transfer_config is None:
            return None
        context = KVConnectorContext(self.config.kv_transfer_config, self.config, self.config.block_size,
                                     dtype=self.dtype)
        return build_scheduler_connector(self.plugins, context)

    def _lora_manager(self) -> LoRAManager | None:
        """Where LoRA is enabled: adapters are checked against the layers rank 0's model wraps."""
        if not self.config.enable_lora:
            return None
        targets = self.executor.collective_rpc("lora_targets")[0]
        loader = LoRAAdapterLoader(targets, self.config.max_lora_rank, self.dtype)
        return LoRAManager(loader, self.config.max_loras, self.config.lora_host_cache_size)

    def _init_kv_cache(self) -> int:
        per_block = self.executor.kv_bytes_per_block()
        if per_block == 0:  # an encoder caches nothing: its blocks only count the tokens it runs
            return self.config.num_kv_blocks or self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        num_blocks = self.config.num_kv_blocks or self.executor.kv_cache_budget() // per_block
        needed = -(-self.max_model_len // self.config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.config.block_size} tokens, fewer than one "
                f"max_model_len={self.max_model_len} sequence needs ({needed}); raise kv_cache_memory or lower max_model_len"
            )
        self.executor.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, kv_cache_dtype %s)", num_blocks,
                    self.config.block_size, num_blocks * per_block / 2**20, self.config.kv_cache_dtype)
        return num_blocks

    def _describe_model(self) -> ModelInfo:
        architectures = self.checkpoint.architectures
        return ModelInfo(
            path=str(self.checkpoint.path),
            architecture=architectures[0] if architectures else None,
            vocab_size=int(self.checkpoint.text_config.vocab_size),
            max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id,
            extra_stop_token_ids=tuple(self.extra_stop_token_ids),
            dtype=self.worker_spec.dtype,
            device_type=self.platform.device_type,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.block_size,
            **self.runner.model_info_fields(self.max_model_len, self.config.max_num_batched_tokens),
        )

    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def tokenizer(self) -> Any:
        return self.checkpoint.tokenizer

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests' blocks the KV connector still keeps: an idle engine steps now and
        then (``AsyncLLM``) so that they are freed once sent or their lease ends."""
        return self.scheduler.has_kept_blocks

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` (a core request) is waiting or running."""
        return request_id in self.scheduler.requests

    def make_stats(self) -> SchedulerSnapshot:
        """The scheduler's snapshot now (each step's outputs carry the one after that step)."""
        return self.scheduler.make_stats()

    def step(self) -> EngineCoreOutputs:
        if not self._warned_thread and threading.get_ident() != self._building_thread:
            self._warn_other_thread()
        if self.micro_batches is None:
            scheduler_output = self.scheduler.schedule()
        else:  # the oldest micro-batch's outputs; or an empty step, none in flight, that runs here
            ready = self.micro_batches.step()
            if isinstance(ready, EngineCoreOutputs):
                return ready
            scheduler_output = ready
        if scheduler_output.is_empty and self.structured_output.num_pending:
            self.structured_output.wait_for_any(_GRAMMAR_WAIT_S)
        if scheduler_output.is_empty and self.lora is not None and self.lora.num_loading:
            self.lora.wait_for_any(_GRAMMAR_WAIT_S)
        forward = self.executor.execute_model(scheduler_output, non_block=True)
        # Built while the forward runs, where the executor runs it elsewhere (in place: after it).
        grammar = self.scheduler.grammar_bitmask(scheduler_output)
        forward.result()
        runner_output = self.executor.sample_tokens(grammar)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        kv_news = runner_output.kv_connector_output
        if scheduler_output.is_empty and self.scheduler.waiting_for_remote_kvs and (kv_news is None or kv_news.is_empty):
            time.sleep(_KV_LOAD_WAIT_S)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(), scheduler_output.total_num_scheduled_tokens)

    def _warn_other_thread(self) -> None:
        """Once, where the platform's compute threads belong to the thread that started them
        (``thread_affine``: the CPU's OpenMP teams), stepping from another thread is slow."""
        self._warned_thread = True
        if platform_is_thread_affine(self.platform):
            logger.warning(
                "the engine was built on thread %s and is stepped on thread %s: on the %s platform its "
                "compute threads belong to the building thread, and decoding runs 1.5-1.8x slower this way; "
                "build the LLM on the thread that generates with it (docs/operations.md)",
                self._building_thread, threading.get_ident(), self.platform.name)

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        if self.lora is not None:
            self.lora.shutdown()
        self.executor.shutdown()


def eos_token_ids(generation_config: dict[str, Any], tokenizer: Any) -> tuple[int | None, list[int]]:
    """The primary EOS id, and the other ids the generation config says also end a sequence."""
    configured = generation_config.get("eos_token_id")
    ids = configured if isinstance(configured, list) else [configured] if configured is not None else []
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if primary is None and ids:
        primary = ids[0]
    return primary, [i for i in ids if i != primary]


def _max_model_len(config: EngineConfig, checkpoint: Checkpoint, spec: ModelSpec | None = None) -> int:
    if spec is not None and spec.max_positions is not None:  # a position table with reserved rows (RoBERTa)
        native: int | None = spec.max_positions(checkpoint.hf_config)
    else:
        native = getattr(checkpoint.text_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if native is None:
            raise ModelNotFoundError("the model config gives no max_position_embeddings: set max_model_len")
        return int(native)
    if native is not None and config.max_model_len > native:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {native} positions")
    return config.max_model_len


def _draft_backoff_options(speculative: Any, target_config: Any) -> dict[str, Any]:
    """The scheduler's off-switches for drafts that rarely hit and for batches too large to draft
    for, from ``speculative_config`` (the acceptance rate, unless given, where drafting breaks even)."""
    if speculative is None:
        return {}
    rate = speculative.min_acceptance_rate
    if rate is None:
        rate = break_even_acceptance_rate(speculative, target_config)
    return dict(spec_min_acceptance_rate=rate, spec_acceptance_window=speculative.acceptance_window,
                spec_backoff_tokens=speculative.backoff_tokens,
                spec_disable_by_batch_size=speculative.disable_by_batch_size or 0)
