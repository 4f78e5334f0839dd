"""From the core's per-step token ids to ``RequestOutput``s: detokenize,
apply stop strings, gather logprobs, and merge the ``n`` samples of a request."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.metrics.stats import IterationStats, RequestTimer
from tokenmill.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from tokenmill.request import RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.output import EngineCoreOutput

logger = logging.getLogger(__name__)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    stopped: list[str]  # core requests a stop string ended: the core must finish them
    failed: list[str]  # core requests whose output processing raised: the core must fail them


@dataclass
class _Sample:
    """One of a request's ``n`` samples (the whole request when ``n == 1``)."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.detokenizer.text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, _Sample]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    embedding: list[float] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # the first sample's that has any (n samples: one prompt)
    # The caller reads only the finished output (LLM.generate): no output per step, and no
    # text before the end where no stop string needs it.
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())

    def output(self) -> RequestOutput:
        completions = [s.completion() for s in sorted(self.samples.values(), key=lambda s: s.index)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
                             self.prompt_logprobs, self.num_cached_tokens, self.error, embedding=self.embedding,
                             kv_transfer_params=self.kv_transfer_params)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._parent_of: dict[str, str] = {}  # core request id -> parent id
        self._timers: dict[str, RequestTimer] = {}  # core request id -> its timestamps
        self._stats = IterationStats()

    def take_stats(self) -> IterationStats:
        """What happened since the last call (steps and aborts)."""
        stats, self._stats = self._stats, IterationStats()
        return stats

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    children: list[tuple[str, SamplingParams]], final_only: bool = False) -> None:
        """``final_only``: ``process`` returns this request's output once, when it finishes (a
        caller that reads nothing before the end saves building an output per step), and a sample
        without stop strings is detokenized then, in one go (the same text)."""
        samples = {
            child_id: _Sample(i, params, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                              logprobs=[] if params.logprobs is not None else None,
                              cumulative_logprob=0.0 if params.logprobs is not None else None)
            for i, (child_id, params) in enumerate(children)
        }
        self._parents[request_id] = _Parent(request_id, prompt, prompt_token_ids, samples, final_only=final_only)
        self._parent_of.update({child_id: request_id for child_id in samples})
        arrival = time.monotonic()
        self._timers.update({child_id: RequestTimer(arrival, len(prompt_token_ids)) for child_id in samples})

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def child_ids(self, request_id: str) -> list[str]:
        return list(self._parents[request_id].samples) if request_id in self._parents else []

    def request_ids(self) -> list[str]:
        return list(self._parents)

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    def process(self, core_outputs: list[EngineCoreOutput], step_start: float | None = None) -> ProcessedOutputs:
        """The updated requests' outputs, and the core requests a stop string ended or that failed here."""
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        result = ProcessedOutputs([], [], [])
        for out in core_outputs:
            parent_id = self._parent_of.get(out.req_id)
            if parent_id is None:
                continue
            parent = self._parents[parent_id]
            sample = parent.samples[out.req_id]
            self._time_step(out, step_start if step_start is not None else now, now)
            try:
                if self._update_sample(parent, sample, out):
                    result.stopped.append(out.req_id)
            except Exception as exc:  # e.g. the detokenizer: this request fails, the batch goes on
                logger.warning("request %s failed in output processing: %r", out.req_id, exc)
                sample.finish_reason = RequestStatus.FINISHED_ERROR.finish_reason
                parent.error = parent.error or f"output processing failed: {type(exc).__name__}: {exc}"
                if out.finish_status is None:  # still live in the core: the engine must end it there
                    result.failed.append(out.req_id)
            if sample.finish_reason is not None:
                self._finish_timer(out.req_id, sample.finish_reason, now)
            touched[parent_id] = parent
        result.outputs = [self._emit(parent) for parent in touched.values()
                          if not parent.final_only or parent.finished]
        return result

    def _time_step(self, out: EngineCoreOutput, step_start: float, now: float) -> None:
        timer = self._timers.get(out.req_id)
        if timer is None:
            return
        if out.new_token_ids and timer.first_token is None:
            self._stats.num_prompt_tokens += timer.num_prompt_tokens
        timer.on_step(step_start, now, len(out.new_token_ids), self._stats)

    def _finish_timer(self, req_id: str, reason: str, now: float) -> None:
        timer = self._timers.pop(req_id, None)
        if timer is not None:
            self._stats.finished.append(timer.finish(reason, now))
            if reason in ("abort", "timeout"):
                self._stats.num_aborted += 1

    def finish(self, req_id: str, status: RequestStatus, error: str | None = None) -> RequestOutput | None:
        """Mark a core request finished from outside the step (abort, timeout, error)."""
        parent_id = self._parent_of.get(req_id)
        if parent_id is None:
            return None
        parent = self._parents[parent_id]
        sample = parent.samples[req_id]
        if sample.finish_reason is None:
            sample.finish_reason = status.finish_reason
            self._finish_timer(req_id, sample.finish_reason or "abort", time.monotonic())
        parent.error = parent.error or error
        try:
            if sample.params.detokenize and _text_waits_for_end(parent, sample):
                _catch_up_text(sample)
        except Exception as exc:
            logger.warning("request %s failed in output processing: %r", req_id, exc)
            parent.error = parent.error or f"output processing failed: {type(exc).__name__}: {exc}"
        if parent.final_only and not parent.finished:
            return None
        return self._emit(parent)

    def _emit(self, parent: _Parent) -> RequestOutput:
        output = parent.output()
        if output.finished:
            del self._parents[parent.request_id]
            for child_id in parent.samples:
                self._parent_of.pop(child_id, None)
        return output

    def _update_sample(self, parent: _Parent, sample: _Sample, out: EngineCoreOutput) -> bool:
        parent.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:
            parent.embedding = out.pooled
        if out.kv_transfer_params is not None and parent.kv_transfer_params is None:
            parent.kv_transfer_params = out.kv_transfer_params
        if out.new_prompt_logprobs is not None:
            parent.prompt_logprobs = [None] + [self._logprob_dict(e) for e in out.new_prompt_logprobs]
        sample.token_ids.extend(out.new_token_ids)
        if sample.logprobs is not None and out.new_logprobs:
            for entries in out.new_logprobs:
                sample.logprobs.append(self._logprob_dict(entries))
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + entries[0][1]
        if not sample.params.detokenize:
            stop = None  # no text wanted, so no stop string either (SamplingParams allows none)
        elif _text_waits_for_end(parent, sample):
            if out.finish_status is None:
                return False  # no stop string to look for: the text is made once it finishes
            stop = _catch_up_text(sample)
        else:
            stop = sample.detokenizer.add_tokens(out.new_token_ids)
        if stop is not None and out.finish_status is None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            return True
        if out.finish_status is not None:
            sample.finish_reason = RequestStatus(out.finish_status).finish_reason
            sample.stop_reason = stop if stop is not None else out.stop_reason
            parent.error = parent.error or out.error
        return False

    def _logprob_dict(self, entries: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        return {token: Logprob(logprob, rank, self._decode(token)) for token, logprob, rank in entries}

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])


def _text_waits_for_end(parent: _Parent, sample: _Sample) -> bool:
    """Whether the sample is detokenized once it finishes, not per step: its caller reads only
    the finished output, and no stop string needs the text before."""
    return parent.final_only and not sample.detokenizer.has_stop_strings


def _catch_up_text(sample: _Sample) -> str | None:
    """Detokenize the sample's tokens the detokenizer has not seen (a ``final_only`` sample's,
    which waits for its end); the stop string that matched, if any."""
    return sample.detokenizer.add_tokens(sample.token_ids[sample.detokenizer.num_tokens:])
