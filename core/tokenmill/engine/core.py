"""The engine core: the scheduler, the KV cache manager and the executor,
and one ``step()`` that moves every running request forward."""

from __future__ import annotations

import logging
import threading
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.errors import ModelNotFoundError
from tokenmill.executor import Executor, UniProcExecutor
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.model_loader.loader import default_model, load_checkpoint
from tokenmill.platform import Platform, detect_platform, platform_is_thread_affine, resolve_dtype
from tokenmill.plugins.manager import PluginManager, get_plugin_manager
from tokenmill.plugins.options import plugin_option_specs, resolve_plugin_options
from tokenmill.request import Request, RequestStatus
from tokenmill.scheduler.output import EngineCoreOutput
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.structured_output.manager import StructuredOutputManager

# With nothing runnable but requests whose grammar compiles, step() waits this
# long for one to finish instead of spinning on empty steps.
_GRAMMAR_WAIT_S = 0.05

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
        self.max_model_len = _max_model_len(config, self.checkpoint)
        self.eos_token_id, self.extra_stop_token_ids = eos_token_ids(self.checkpoint.generation_config,
                                                                     self.checkpoint.tokenizer)
        self.executor: Executor = UniProcExecutor(config, self.platform, plugins=self.plugins,
                                                  checkpoint=self.checkpoint, dtype=self.dtype,
                                                  max_model_len=self.max_model_len, progress=progress)
        self.num_kv_blocks = self._init_kv_cache()
        self.kv_manager = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        vocab_size = self.checkpoint.hf_config.vocab_size
        stop_ids = [t for t in [self.eos_token_id, *self.extra_stop_token_ids] if t is not None]
        self.structured_output = StructuredOutputManager.from_plugins(
            self.plugins, config.structured_outputs_backend, self.checkpoint.tokenizer, vocab_size, stop_ids)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
        ), self.kv_manager, self.structured_output)
        self.last_num_scheduled_tokens = 0
        self._building_thread = threading.get_ident()
        self._warned_thread = False

    def _init_kv_cache(self) -> int:
        per_block = self.executor.kv_bytes_per_block()
        num_blocks = self.config.num_kv_blocks or self.executor.kv_cache_budget() // per_block
        needed = -(-self.max_model_len // self.config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.config.block_size} tokens, fewer than one "
                f"max_model_len={self.max_model_len} sequence needs ({needed}); raise kv_cache_memory or lower max_model_len"
            )
        self.executor.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.config.block_size,
                    num_blocks * per_block / 2**20)
        return num_blocks

    @property
    def tokenizer(self) -> Any:
        return self.checkpoint.tokenizer

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> list[EngineCoreOutput]:
        if not self._warned_thread and threading.get_ident() != self._building_thread:
            self._warn_other_thread()
        scheduler_output = self.scheduler.schedule()
        self.last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        if scheduler_output.is_empty and self.structured_output.num_pending:
            self.structured_output.wait_for_any(_GRAMMAR_WAIT_S)
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

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
        self.executor.shutdown()


def eos_token_ids(generation_config: dict[str, Any], tokenizer: Any) -> tuple[int | None, list[int]]:
    """The primary EOS id, and the other ids the generation config says also end a sequence."""
    configured = generation_config.get("eos_token_id")
    ids = configured if isinstance(configured, list) else [configured] if configured is not None else []
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if primary is None and ids:
        primary = ids[0]
    return primary, [i for i in ids if i != primary]


def _max_model_len(config: EngineConfig, checkpoint: Checkpoint) -> int:
    native = getattr(checkpoint.hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if native is None:
            raise ModelNotFoundError("the model config gives no max_position_embeddings: set max_model_len")
        return int(native)
    if native is not None and config.max_model_len > native:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {native} positions")
    return config.max_model_len
