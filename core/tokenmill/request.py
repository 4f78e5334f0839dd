"""A request's whole lifecycle in one object, and its state machine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NewType

from tokenmill.errors import InvalidStateTransition
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.structured_output.backend import GrammarMatcher

RequestId = NewType("RequestId", str)
BlockHash = NewType("BlockHash", bytes)


class RequestStatus(enum.IntEnum):
    """Ordered: every status above ``PREEMPTED`` is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_LORA = enum.auto()  # its adapter loads, or waits for a free device slot
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_TIMEOUT = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason of a finished status."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
}

_FINISHED = frozenset(s for s in RequestStatus if s.is_finished)
_WAITING_KINDS = frozenset({RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS,
                            RequestStatus.WAITING_FOR_LORA})
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, *_WAITING_KINDS}) | _FINISHED,
    RequestStatus.WAITING_FOR_GRAMMAR: frozenset({RequestStatus.WAITING}) | _FINISHED,
    RequestStatus.WAITING_FOR_REMOTE_KVS: frozenset({RequestStatus.WAITING}) | _FINISHED,
    RequestStatus.WAITING_FOR_LORA: frozenset({RequestStatus.WAITING}) | _FINISHED,
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED}) | _FINISHED,
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING}) | _FINISHED,
    **{s: frozenset() for s in _FINISHED},
}


@dataclass(eq=False)
class Request:
    """A request as the scheduler and the KV cache manager see it.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache; the
    request still needs ``num_tokens - num_computed_tokens`` tokens computed
    before it can sample again.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    lora_name: str | None = None
    lora_content_hash: str | None = None  # set once the adapter is loaded; its blocks' prefix-cache key
    mm_hashes: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, length, hash)
    mm_inputs: list[Any] = field(default_factory=list)  # its MultiModalItems, for the workers' encoder
    cache_salt: str | None = None
    max_tokens: int = 16  # the effective limit, max_model_len included
    pooling: str | None = None  # "last" or "mean": an embedding request, prefill only

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first scheduling; -1 until known
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    # Structured outputs: the matcher, set once the grammar is compiled.
    grammar: GrammarMatcher | None = None
    # Speculative decoding: the draft tokens proposed after the last step, for the next one to
    # verify. Never part of ``output_token_ids`` (nor of a block hash) until accepted.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prompt_only(self) -> bool:
        """``max_tokens`` 0: the prompt is prefilled (for its logprobs) and no token is sampled."""
        return self.max_tokens == 0 and self.pooling is None

    @property
    def needs_every_position(self) -> bool:
        """Prompt logprobs and mean pooling need every prompt position computed: no prefix-cache hit."""
        return self.sampling_params.prompt_logprobs is not None or self.pooling is not None

    def transition(self, new: RequestStatus) -> None:
        """Move to ``new``; raises :class:`InvalidStateTransition` if not allowed."""
        if new not in _ALLOWED[self.status]:
            raise InvalidStateTransition(
                f"request {self.request_id}: cannot go from {self.status.name} to {new.name}"
            )
        self.status = new

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
