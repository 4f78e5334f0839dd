"""``POST /v1/completions``: prompts in, text out, whole or streamed.

A batch of prompts runs as one engine request per prompt, concurrently;
choice ``i * n + j`` is sample ``j`` of prompt ``i``, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenmill.engine.input_processor import PromptType
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill_cli.server.errors import STREAMING_RESPONSES, APIError, exception_body, output_error
from tokenmill_cli.server.lifecycle import check_admitting
from tokenmill_cli.server.logprobs import (
    completion_logprobs,
    merge_completion_logprobs,
    padded_logprobs,
    prompt_logprobs,
)
from tokenmill_cli.server.protocol import CompletionRequest, Prompt
from tokenmill_cli.server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    new_id,
    usage_of,
)
from tokenmill_cli.server.sampling import completion_sampling_params
from tokenmill_cli.server.state import ServerState, State
from tokenmill_cli.server.streaming import (
    DONE,
    DeltaTracker,
    SSEResponse,
    last_outputs,
    merge_streams,
    sse_event,
    stop_holdback,
    until_disconnected,
)

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=CompletionResponse, responses=STREAMING_RESPONSES,
             dependencies=[Depends(check_admitting)])
async def create_completion(body: CompletionRequest, request: Request, state: State) -> Response:
    return await until_disconnected(request, _serve(body, state, request))


def engine_prompts(prompt: Prompt, param: str = "prompt") -> list[PromptType]:
    """OpenAI's four prompt forms -> one engine prompt each."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


async def _serve(body: CompletionRequest, state: ServerState, request: Request) -> Response:
    model = state.model_name(body.model)
    params = completion_sampling_params(body)
    prompts = engine_prompts(body.prompt)
    request_id = new_id("cmpl")
    lora = state.lora_request(body.model)
    merged = merge_streams([state.engine.generate(p, params, request_id=f"{request_id}-{i}", priority=body.priority,
                                                  timeout=body.timeout, lora_request=lora)
                            for i, p in enumerate(prompts)])
    view = _View(body, params, state.tokenizer)
    if body.stream:
        first = await anext(merged)  # input errors surface here, before the 200
        stream = _Stream(request_id, model, view, len(prompts))
        return SSEResponse(request, stream.events(first, merged), on_close=merged.aclose)
    finals = await last_outputs(merged, len(prompts))
    for output in finals:
        if (error := output_error(output)) is not None:
            raise error
    choices = [view.choice(i * params.n + s.index, out, s) for i, out in enumerate(finals) for s in out.outputs]
    response = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage_of(finals),
                                  kv_transfer_params=next((o.kv_transfer_params for o in finals
                                                           if o.kv_transfer_params is not None), None))
    return JSONResponse(response.model_dump())


@dataclass
class _View:
    """How one request's outputs read as choices: echo and logprobs applied."""

    body: CompletionRequest
    params: SamplingParams
    tokenizer: Any

    def prompt_text(self, output: RequestOutput) -> str:
        if not self.body.echo:
            return ""
        return output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)

    def choice(self, index: int, output: RequestOutput, sample: CompletionOutput) -> CompletionChoice:
        prefix = self.prompt_text(output)
        logprobs = None
        if self.body.logprobs is not None:
            parts = [self.prompt_logprobs(output)] if self.body.echo else []
            parts.append(self.sample_logprobs(sample, 0, len(sample.token_ids), len(prefix)))
            logprobs = merge_completion_logprobs(parts)
        return CompletionChoice(index=index, text=prefix + sample.text, logprobs=logprobs,
                                prompt_logprobs=self.vllm_prompt_logprobs(output),
                                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)

    def vllm_prompt_logprobs(self, output: RequestOutput) -> list[Any] | None:
        if self.body.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.tokenizer, output.prompt_token_ids, output.prompt_logprobs)

    def prompt_logprobs(self, output: RequestOutput) -> CompletionLogprobs:
        ids = output.prompt_token_ids
        return completion_logprobs(self.tokenizer, ids, padded_logprobs(output.prompt_logprobs, len(ids)), 0)

    def sample_logprobs(self, sample: CompletionOutput, start: int, end: int, offset: int) -> CompletionLogprobs:
        entries = padded_logprobs(sample.logprobs, len(sample.token_ids))[start:end]
        return completion_logprobs(self.tokenizer, sample.token_ids[start:end], entries, offset)


@dataclass
class _Stream:
    """Turns merged cumulative outputs into SSE chunks, one per choice per step with new text."""

    request_id: str
    model: str
    view: _View
    num_prompts: int
    trackers: dict[int, DeltaTracker] = field(default_factory=dict)
    latest: dict[int, RequestOutput] = field(default_factory=dict)
    aborted: APIError | None = None  # the server ended the request: said after its last chunk
    params_sent: set[int] = field(default_factory=set)  # prompts whose kv_transfer_params went out

    async def events(self, first: tuple[int, RequestOutput],
                     rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        try:
            for chunk in self._chunks(*first):
                yield sse_event(chunk)
            async for index, output in rest:
                for chunk in self._chunks(index, output):
                    yield sse_event(chunk)
            if self.view.body.include_usage:
                yield sse_event(CompletionResponse(id=self.request_id, model=self.model, choices=[],
                                                   usage=usage_of(list(self.latest.values()))))
            if self.aborted is not None:
                yield sse_event(exception_body(self.aborted))
        except Exception as exc:  # the 200 is sent: report in-band, as OpenAI's streams do
            yield sse_event(exception_body(exc))
        yield DONE

    def _chunks(self, prompt_index: int, output: RequestOutput) -> list[CompletionResponse]:
        self.latest[prompt_index] = output
        if (error := output_error(output)) is not None:
            if error.code != "request_aborted":
                raise error
            self.aborted = error  # the chunks (finish_reason "abort") still go out first
        chunks = []
        for sample in output.outputs:
            choice = self._choice(prompt_index * self.view.params.n + sample.index, output, sample)
            if choice is not None:
                chunks.append(CompletionResponse(id=self.request_id, model=self.model, choices=[choice],
                                                 kv_transfer_params=self._transfer_params(prompt_index, choice,
                                                                                          output)))
        return chunks

    def _transfer_params(self, prompt_index: int, choice: CompletionChoice,
                         output: RequestOutput) -> dict[str, Any] | None:
        """A prompt's KV connector answer, once, on the chunk that finishes one of its choices."""
        if choice.finish_reason is None or output.kv_transfer_params is None or prompt_index in self.params_sent:
            return None
        self.params_sent.add(prompt_index)
        return output.kv_transfer_params

    def _choice(self, index: int, output: RequestOutput, sample: CompletionOutput) -> CompletionChoice | None:
        tracker = self.trackers.setdefault(index, DeltaTracker(stop_holdback(self.view.params.stop)))
        first = not tracker.started
        sent_chars = tracker.sent_chars
        delta = tracker.advance(sample)
        if delta is None:
            return None
        prefix = self.view.prompt_text(output) if first else ""
        logprobs = None
        if self.view.body.logprobs is not None:
            offset = len(self.view.prompt_text(output)) + sent_chars
            parts = [self.view.prompt_logprobs(output)] if first and self.view.body.echo else []
            parts.append(self.view.sample_logprobs(sample, delta.token_start, delta.token_end, offset))
            logprobs = merge_completion_logprobs(parts)
        return CompletionChoice(index=index, text=prefix + delta.text, logprobs=logprobs,
                                prompt_logprobs=self.view.vllm_prompt_logprobs(output) if first else None,
                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
