"""Per-request sampling parameters, with the same names and defaults as vLLM."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.kv_transfer.params import KV_TRANSFER_PARAMS, KVTransferParams
from tokenmill.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample and when to stop, for one request.

    Invalid values raise :class:`~tokenmill.errors.InvalidRequestError` naming
    the parameter, at construction time.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: the outputs carry token ids and no text (``CompletionOutput.text`` stays ""), which
    # saves the per-token detokenizing of a caller that reads only tokens (bench latency).
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (a dict of
    # StructuredOutputsParams' fields is accepted too); the grammar, not
    # ignore_eos, decides when the output ends.
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k < 0:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, "temperature", f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, "repetition_penalty",
             f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            # 0 scores the prompt alone: it is computed (prompt_logprobs), no token is sampled
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens",
             f"max_tokens must be non-negative, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs",
             f"logprobs must be non-negative, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}"),
            (self.seed is None or -(2**63) <= self.seed < 2**63, "seed",
             f"seed must fit in 64 bits, got {self.seed}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
        if isinstance(self.structured_outputs, dict):  # the JSON form, e.g. {"regex": "[0-9]+"}
            self.structured_outputs = _structured_from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams or a dict",
                                      param="structured_outputs")
        if self.logit_bias and not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                       for t in self.logit_bias):
            raise InvalidRequestError("logit_bias keys must be token ids (integers)", param="logit_bias")
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            # a NaN or inf bias would poison the whole logits row (the sampler guards too)
            raise InvalidRequestError("logit_bias values must be finite numbers", param="logit_bias")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need the text: they cannot be used with detokenize=False",
                                      param="detokenize")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", param="stop_token_ids")
        KVTransferParams.parse(self.extra_args.get(KV_TRANSFER_PARAMS))  # a connector reads them mid-step: check now

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of the ``index``-th of ``n`` samples (each its own seed)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _structured_from_dict(fields: dict[str, Any]) -> StructuredOutputsParams:
    known = set(StructuredOutputsParams.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidRequestError(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}",
                                  param="structured_outputs")
    return StructuredOutputsParams(**fields)
