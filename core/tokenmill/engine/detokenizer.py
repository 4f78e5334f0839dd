"""Incremental detokenization and stop strings.

Text grows token by token through ``tokenizers``' ``DecodeStream`` (primed
with the prompt, so word boundaries and multi-byte characters come out as a
full decode would give them). A stop string ends the request; the text is
cut before it unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

from typing import Any

from tokenmill.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=params.skip_special_tokens)
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self.text = ""

    @property
    def num_tokens(self) -> int:
        """The tokens added so far."""
        return self._num_tokens

    @property
    def has_stop_strings(self) -> bool:
        """Whether the text must grow token by token to find where the request stops."""
        return bool(self._stops)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that matched, if any."""
        for token_id in token_ids:
            self._num_tokens += 1
            chunk = self._stream.step(self._backend, token_id)
            if not chunk:
                continue
            previous = len(self.text)
            self.text += chunk
            if self._stops and self._num_tokens > self._min_tokens:
                stop = self._find_stop(previous)
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, new_from: int) -> str | None:
        """Search only where a stop string could newly end (it may start in older text)."""
        for stop in self._stops:
            start = max(0, new_from - len(stop) + 1)
            at = self.text.find(stop, start)
            if at != -1:
                self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
                return stop
        return None
