"""Turning what a caller sends into validated requests the core can run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.request import Request, RequestId
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.params import StructuredOutputsParams

# A text prompt, or vLLM's dict forms: {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = str | Mapping[str, Any]
POOLING_TYPES = ("last", "mean")


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, eos_token_id: int | None,
                 extra_stop_token_ids: list[int],
                 validate_structured_outputs: Callable[[StructuredOutputsParams], None] | None = None) -> None:
        self.tokenizer = tokenizer
        # The structured-output backend's check: a bad schema, regex or grammar fails here, in the
        # submitting thread, as an InvalidRequestError, never inside the engine loop.
        self.validate_structured_outputs = validate_structured_outputs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.extra_stop_token_ids = extra_stop_token_ids

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        if prompt == "" or (isinstance(prompt, Mapping) and prompt.get("prompt") == ""):
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if isinstance(prompt, str):
            processed = ProcessedPrompt(prompt, self._encode(prompt))
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            processed = ProcessedPrompt(prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]],
                                        prompt.get("cache_salt"))
        elif isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            processed = ProcessedPrompt(prompt["prompt"], self._encode(prompt["prompt"]), prompt.get("cache_salt"))
        else:
            raise InvalidRequestError(
                "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}", param="prompt")
        self._validate(processed.token_ids)
        return processed

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids", param="prompt")
        return list(self.tokenizer.encode(text))

    def _validate(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, which leaves no room to generate within the model's "
                f"context of {self.max_model_len} tokens (max_model_len)", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})",
                                      param="prompt")

    def make_pooling_request(self, request_id: str, prompt: ProcessedPrompt, pooling: str) -> Request:
        if pooling not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling must be one of {POOLING_TYPES}, got {pooling!r}", param="pooling")
        return Request(request_id=RequestId(request_id), prompt_token_ids=prompt.token_ids,
                       sampling_params=SamplingParams(max_tokens=1), pooling=pooling, max_tokens=1,
                       cache_salt=prompt.cache_salt)

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                      priority: int = 0, lora_name: str | None = None) -> list[Request]:
        """One request per sample; ``n > 1`` fans out into children ``{i}_{id}``."""
        if params.logit_bias and any(not 0 <= int(t) < self.vocab_size for t in params.logit_bias):
            raise InvalidRequestError("logit_bias names token ids outside the vocabulary", param="logit_bias")
        if params.structured_outputs is not None:
            if self.validate_structured_outputs is None:
                raise InvalidRequestError("this engine has no structured-output backend", param="structured_outputs")
            self.validate_structured_outputs(params.structured_outputs)
        room = self.max_model_len - len(prompt.token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        children = [params] if params.n == 1 else [params.for_child(i) for i in range(params.n)]
        ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        return [self._request(RequestId(rid), prompt, p, max_tokens, priority, lora_name)
                for rid, p in zip(ids, children, strict=True)]

    def _request(self, request_id: RequestId, prompt: ProcessedPrompt, params: SamplingParams, max_tokens: int,
                 priority: int, lora_name: str | None) -> Request:
        if self.extra_stop_token_ids and not params.ignore_eos:
            params = _with_stop_ids(params, self.extra_stop_token_ids)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            priority=priority,
            lora_name=lora_name,
            cache_salt=prompt.cache_salt,
            max_tokens=max_tokens,
        )


def _with_stop_ids(params: SamplingParams, extra: list[int]) -> SamplingParams:
    """The generation config's other EOS ids stop too (a copy: the caller's params stay as given)."""
    from dataclasses import replace

    merged = list(dict.fromkeys([*(params.stop_token_ids or []), *extra]))
    return replace(params, stop_token_ids=merged)
