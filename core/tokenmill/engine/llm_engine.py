"""The synchronous engine: input processing, the core and output processing
in one object. ``LLM`` drives it in a loop; ``AsyncLLM`` runs it in a thread."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.deadlines import Deadlines
from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from tokenmill.engine.model_info import ModelInfo
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.errors import InvalidRequestError, InvalidStateTransition
from tokenmill.lora.adapter import LoRAAdapter
from tokenmill.lora.manager import LoRAManager
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import SchedulerSnapshot, StatLogger
from tokenmill.model_loader.checkpoint import Checkpoint
from tokenmill.multimodal.loading import computes_items_whole, multimodal_processor
from tokenmill.outputs import RequestOutput
from tokenmill.plugins.manager import PluginManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A validated request (its ``n`` samples as core requests), ready to queue."""

    request_id: str
    prompt: ProcessedPrompt
    requests: list[Request]


class LLMEngine:
    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None, progress: bool = False,
                 stat_loggers: list[StatLogger] | None = None) -> None:
        self.config = config
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.core = EngineCore(config, plugins, progress=progress)
        self.tokenizer = self.core.tokenizer
        self.model_info = self.core.model_info()
        self.input_processor = build_input_processor(self.core.checkpoint, self.model_info, self.core.plugins,
                                                     config, self.core.structured_output.validate)
        # The scheduler's stats as of the last step (or abort): what the front end reads.
        self.scheduler_stats: SchedulerSnapshot = self.core.make_stats()
        self.output_processor = OutputProcessor(self.tokenizer)
        self.deadlines = Deadlines()
        self._ids = itertools.count()
        self._failed_loggers: set[int] = set()
        self.stat_logging_seconds = 0.0  # time spent recording statistics: what metrics cost

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished

    @property
    def num_deadlines(self) -> int:
        """Requests with a timeout still pending."""
        return len(self.deadlines)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def prepare_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                        priority: int = 0, pooling: str | None = None,
                        truncate_prompt_tokens: int | None = None,
                        lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Tokenize and validate; raises ``InvalidRequestError``. Touches no engine state,
        so a front end may call it from any thread. ``pooling`` makes it an embedding request
        (``"auto"``: the model's own pooling); ``lora_request`` runs it with that adapter
        (registered with :meth:`add_lora` by the time the request is queued)."""
        return prepare_request(self.input_processor, self.model_info, request_id, prompt, params, priority,
                               pooling, truncate_prompt_tokens, lora_request)

    def add_prepared(self, prepared: PreparedRequest, timeout: float | None = None, final_only: bool = False) -> None:
        """Queue a prepared request; it ends with finish_reason ``timeout`` once ``timeout`` seconds
        (default: ``config.request_timeout``) have passed since now. ``final_only``: :meth:`step`
        returns its output only once it has finished (``OutputProcessor.add_request``)."""
        if self.output_processor.has_request(prepared.request_id):
            raise ValueError(f"request id {prepared.request_id!r} is already running")
        lora_name = prepared.requests[0].lora_name if prepared.requests else None
        if lora_name is not None:
            self.lora.get(lora_name)  # an adapter unloaded since: fail before anything is queued
        self.output_processor.add_request(prepared.request_id, prepared.prompt.text, prepared.prompt.token_ids,
                                          [(r.request_id, r.sampling_params) for r in prepared.requests],
                                          final_only=final_only)
        for request in prepared.requests:
            self.core.add_request(request)
        timeout = self.config.request_timeout if timeout is None else timeout
        if timeout is not None:
            self.deadlines.add(prepared.request_id, time.monotonic(), timeout)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    timeout: float | None = None) -> None:
        """Validate and queue one request; raises ``InvalidRequestError`` and queues nothing if it is bad."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, priority), timeout)

    # -- LoRA adapters --------------------------------------------------------
    @property
    def lora(self) -> LoRAManager:
        if self.core.lora is None:
            raise InvalidRequestError("this engine was started without enable_lora", param="lora_request")
        return self.core.lora

    def add_lora(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> bool:
        """Register an adapter, reading and checking it now unless ``adapter`` is the one already
        loaded (raises ``LoRAAdapterError``); False if it is registered already."""
        known = self.lora.adapters.get(request.lora_name)
        if known is not None and known.lora_path == request.lora_path:
            return False
        self.lora.add(request, adapter if adapter is not None else self.lora.load_now(request))
        return True

    def remove_lora(self, lora_name: str) -> None:
        """Unregister an adapter; requests that use it finish with it, new ones fail."""
        self.lora.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.core.lora.adapters.values()) if self.core.lora is not None else []

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                      error: str | None = None) -> RequestOutput | None:
        """End a running or waiting request; aborting an unknown or finished one raises."""
        children = self.output_processor.child_ids(request_id)
        if not children:
            raise InvalidStateTransition(f"request {request_id!r} is not running (finished or unknown)")
        live = [c for c in children if self.core.has_request(c)]
        self.core.finish_requests(live, status)
        self.scheduler_stats = self.core.make_stats()
        output = None
        for child in children:
            output = self.output_processor.finish(child, status, error) or output
        self.deadlines.discard(request_id)
        self._record_stats()
        return output

    def abort_all(self, error: str | None = None) -> list[RequestOutput]:
        """Abort every unfinished request (server shutdown), each with ``error`` as its message."""
        return [out for rid in self.output_processor.request_ids()
                if (out := self.abort_request(rid, error=error)) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished > 0

    def has_pending_kv_transfers(self) -> bool:
        """Blocks of finished requests the KV connector keeps (``EngineCore.has_pending_kv_transfers``)."""
        return self.core.has_pending_kv_transfers()

    def step(self) -> list[RequestOutput]:
        timed_out = self._expire_deadlines()
        step_start = time.monotonic()
        core_outputs = self.core.step()
        self.scheduler_stats = core_outputs.stats
        processed = self.output_processor.process(core_outputs.outputs, step_start)
        if processed.stopped:
            self.core.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        if processed.failed:
            self.core.finish_requests(processed.failed, RequestStatus.FINISHED_ERROR)
        if processed.stopped or processed.failed:
            self.scheduler_stats = self.core.make_stats()
        for output in processed.outputs:
            if output.finished:
                self.deadlines.discard(output.request_id)
        self._record_stats(core_outputs.num_scheduled_tokens)
        return timed_out + processed.outputs

    def _expire_deadlines(self) -> list[RequestOutput]:
        if not len(self.deadlines):
            return []
        outputs = []
        for expired in self.deadlines.pop_expired(time.monotonic()):
            if self.output_processor.has_request(expired.request_id):
                output = self.abort_request(expired.request_id, RequestStatus.FINISHED_TIMEOUT,
                                            f"the request timed out after {expired.timeout_s:g} s")
                if output is not None:
                    outputs.append(output)
        return outputs

    def _record_stats(self, num_scheduled_tokens: int = 0) -> None:
        if not self.stat_loggers:
            return
        start = time.perf_counter()
        iteration = self.output_processor.take_stats()
        iteration.num_scheduled_tokens = num_scheduled_tokens
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(self.scheduler_stats, iteration)
            except Exception:  # metrics must never take the engine down
                if id(stat_logger) not in self._failed_loggers:
                    self._failed_loggers.add(id(stat_logger))
                    logger.exception("stat logger %r failed (reported once)", stat_logger)
        self.stat_logging_seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        self.core.shutdown()



def build_input_processor(checkpoint: Checkpoint, model_info: ModelInfo, plugins: PluginManager,
                          config: EngineConfig,
                          validate_structured_outputs: Callable[[StructuredOutputsParams], None] | None,
                          ) -> InputProcessor:
    """The tokenizer-side checks of the model ``checkpoint`` holds: what turns a prompt into
    requests. Built from the checkpoint's folder alone (no weights), so a front end in another
    process than the core's (``AsyncLLM(engine_process=True)``) builds the same one."""
    processor = InputProcessor(checkpoint.tokenizer, model_info.max_model_len, model_info.vocab_size,
                               model_info.eos_token_id, list(model_info.extra_stop_token_ids),
                               validate_structured_outputs=validate_structured_outputs)
    if model_info.is_encoder:
        processor.max_pooling_prompt = model_info.max_prompt_tokens
    processor.multimodal = multimodal_processor(checkpoint, plugins, config.limit_mm_per_prompt)
    if processor.multimodal is not None and computes_items_whole(checkpoint, plugins):
        processor.max_mm_item_tokens = config.max_num_batched_tokens
    return processor


def prepare_request(input_processor: InputProcessor, model_info: ModelInfo, request_id: str, prompt: PromptType,
                    params: SamplingParams | None, priority: int = 0, pooling: str | None = None,
                    truncate_prompt_tokens: int | None = None,
                    lora_request: LoRARequest | None = None) -> PreparedRequest:
    """``LLMEngine.prepare_request`` for any front end that holds the input processor."""
    pooling = check_runner(model_info, pooling)
    processed = input_processor.process_prompt(prompt, pooling is not None, truncate_prompt_tokens)
    if pooling is not None:
        requests = [input_processor.make_pooling_request(request_id, processed, pooling)]
    else:
        requests = input_processor.make_requests(request_id, processed, params or SamplingParams(),
                                                 priority, lora_request.lora_name if lora_request else None)
    return PreparedRequest(request_id, processed, requests)


def check_runner(info: ModelInfo, pooling: str | None) -> str | None:
    """The request's pooling type (``"auto"`` resolved to the model's), after checking that the
    model's runner serves the kind of request it is: an encoder does not generate, and a model
    without pooling support does not embed."""
    name = info.architecture or info.path
    if pooling is None:
        if info.runner == "pooling":
            raise InvalidRequestError(f"the model {name} runs the pooling runner: it computes embeddings and "
                                      "scores, not completions", param="model")
        return None
    if info.pooler is None:
        raise InvalidRequestError(f"the model {name} runs the {info.runner} runner and does not support pooling "
                                  "(embeddings)", param="model")
    return info.pooler.pooling if pooling == "auto" else pooling
