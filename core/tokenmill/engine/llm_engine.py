"""The synchronous engine: input processing, the core and output processing
in one object. ``LLM`` drives it in a loop; ``AsyncLLM`` runs it in a thread."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.errors import InvalidStateTransition
from tokenmill.outputs import RequestOutput
from tokenmill.plugins.manager import PluginManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A validated request (its ``n`` samples as core requests), ready to queue."""

    request_id: str
    prompt: ProcessedPrompt
    requests: list[Request]


class LLMEngine:
    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None, progress: bool = False) -> None:
        self.config = config
        self.core = EngineCore(config, plugins, progress=progress)
        self.tokenizer = self.core.tokenizer
        eos, extra_stops = _eos_ids(self.core.checkpoint.generation_config, self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, self.core.max_model_len,
                                              self.core.checkpoint.hf_config.vocab_size, eos, extra_stops)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def prepare_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                        priority: int = 0, pooling: str | None = None) -> PreparedRequest:
        """Tokenize and validate; raises ``InvalidRequestError``. Touches no engine state,
        so a front end may call it from any thread. ``pooling`` makes it an embedding request."""
        processed = self.input_processor.process_prompt(prompt)
        if pooling is not None:
            requests = [self.input_processor.make_pooling_request(request_id, processed, pooling)]
        else:
            requests = self.input_processor.make_requests(request_id, processed, params or SamplingParams(),
                                                          priority)
        return PreparedRequest(request_id, processed, requests)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        if self.output_processor.has_request(prepared.request_id):
            raise ValueError(f"request id {prepared.request_id!r} is already running")
        self.output_processor.add_request(prepared.request_id, prepared.prompt.text, prepared.prompt.token_ids,
                                          [(r.request_id, r.sampling_params) for r in prepared.requests])
        for request in prepared.requests:
            self.core.add_request(request)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        """Validate and queue one request; raises ``InvalidRequestError`` and queues nothing if it is bad."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, priority))

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                      error: str | None = None) -> RequestOutput | None:
        """End a running or waiting request; aborting an unknown or finished one raises."""
        children = self.output_processor.child_ids(request_id)
        if not children:
            raise InvalidStateTransition(f"request {request_id!r} is not running (finished or unknown)")
        live = [c for c in children if c in self.core.scheduler.requests]
        self.core.finish_requests(live, status)
        output = None
        for child in children:
            output = self.output_processor.finish(child, status, error) or output
        return output

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def shutdown(self) -> None:
        self.core.shutdown()


def _eos_ids(generation_config: dict[str, Any], tokenizer: Any) -> tuple[int | None, list[int]]:
    """The primary EOS id, and the other ids the generation config says also end a sequence."""
    configured = generation_config.get("eos_token_id")
    ids = configured if isinstance(configured, list) else [configured] if configured is not None else []
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if primary is None and ids:
        primary = ids[0]
    return primary, [i for i in ids if i != primary]
