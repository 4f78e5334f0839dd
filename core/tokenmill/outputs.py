"""What the API returns: vLLM's ``RequestOutput`` and ``CompletionOutput`` shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    embedding: list[float] | None = None  # set for pooling (embedding) requests
    # the KV connector's answer once finished (a prefill engine's: where a decode engine finds the KV)
    kv_transfer_params: dict[str, Any] | None = None
