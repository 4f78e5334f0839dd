"""OpenAI request fields -> ``SamplingParams``.

``SamplingParams`` validates what the schema does not (min_tokens against
max_tokens, ...) and names the field in its ``InvalidRequestError``, which
the error handlers turn into a 400.
"""

from __future__ import annotations

from typing import Any

from tokenmill import SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.kv_transfer.params import KV_TRANSFER_PARAMS
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill_cli.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokenmill_cli.server.response_format import request_constraint

_LOGIT_BIAS_LIMIT = 100.0


def completion_sampling_params(request: CompletionRequest) -> SamplingParams:
    # echo with logprobs returns the prompt's logprobs too, as OpenAI's legacy endpoint does
    wanted = [request.logprobs if request.echo else None, request.prompt_logprobs]
    prompt_logprobs = max((w for w in wanted if w is not None), default=None)
    constraint = request_constraint(request.structured_outputs)
    return _sampling_params(request, request.max_tokens, request.logprobs, prompt_logprobs,
                            constraint.params if constraint else None)


def chat_sampling_params(request: ChatCompletionRequest,
                         structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """``structured_outputs``: the request's constraint (response_format, a forced tool call, ...)."""
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return _sampling_params(request, max_tokens, logprobs, request.prompt_logprobs, structured_outputs)


def _sampling_params(request: SamplingFields, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None, structured_outputs: StructuredOutputsParams | None) -> SamplingParams:
    return SamplingParams(
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        seed=request.seed,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logit_bias=parse_logit_bias(request.logit_bias),
        structured_outputs=structured_outputs,
        extra_args=_extra_args(request),
    )


def _extra_args(request: SamplingFields) -> dict[str, Any]:
    """vLLM's ``extra_args``: the request's ``kv_transfer_params``, for the KV connector."""
    if request.kv_transfer_params is None:
        return {}
    return {KV_TRANSFER_PARAMS: request.kv_transfer_params.answer()}


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings; the engine wants token ids. Ids outside the vocabulary
    are rejected by the engine, which knows its size."""
    if not logit_bias:
        return None
    parsed: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
        if not -_LOGIT_BIAS_LIMIT <= bias <= _LOGIT_BIAS_LIMIT:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias")
        parsed[token_id] = bias
    return parsed
