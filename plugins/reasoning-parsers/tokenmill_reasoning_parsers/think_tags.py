"""``<think>reasoning</think>content``: the markers DeepSeek-R1 and Qwen3 share, read whole or
streamed by one state machine (so a streamed reply always splits exactly as the whole one does).

The two families differ only in where the reply starts: DeepSeek-R1's template opens ``<think>``
in the prompt, so its reply starts *inside* the reasoning section; Qwen3 opens it itself, so a
reply that does not start with ``<think>`` has none. The whitespace a model puts between
``</think>`` and its answer belongs to neither part.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, ClassVar

from tokenmill import StructuredOutputsParams
from tokenmill.plugin_api import ReasoningDelta, ReasoningSplit, as_structural_format

START = "<think>"
END = "</think>"
# what the structured-output grammar lets through between "</think>" and the answer
_GAP = {"type": "regex", "pattern": r"[ \t\r\n]{0,4}"}


class Phase(Enum):
    OPENING = "opening"  # nothing decided yet: a <think> may still come
    REASONING = "reasoning"
    GAP = "gap"  # after </think>, before the first non-blank character of the answer
    CONTENT = "content"


class ThinkTagStreamer:
    """One reply's split, fed piece by piece. Holds back only what may be part of a marker."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.phase = Phase.OPENING
        self.had_reasoning = starts_in_reasoning
        self._pending = ""

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        self._pending += delta
        reasoning, content = [], []
        while self._pending or self.phase is Phase.OPENING:
            if self.phase is Phase.OPENING:
                if not self._open(final):
                    break
            elif self.phase is Phase.REASONING:
                reasoning.append(self._take_reasoning(final))
                if self.phase is Phase.REASONING:
                    break
            elif self.phase is Phase.GAP:
                self._pending = self._pending.lstrip()
                if self._pending:
                    self.phase = Phase.CONTENT
            else:
                content.append(self._pending)
                self._pending = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _open(self, final: bool) -> bool:
        """Decide whether the reply opens with <think>; False while it cannot be told yet."""
        blank_free = self._pending.lstrip()
        if blank_free.startswith(START):
            self._pending = blank_free[len(START):]
            self.phase, self.had_reasoning = Phase.REASONING, True
            return True
        if not final and START.startswith(blank_free):  # blanks, or the start of "<think>"
            return False
        self.phase = Phase.REASONING if self.starts_in_reasoning else Phase.CONTENT
        return True

    def _take_reasoning(self, final: bool) -> str:
        end = self._pending.find(END)
        if end >= 0:
            taken, self._pending = self._pending[:end], self._pending[end + len(END):]
            self.phase = Phase.GAP
            return taken
        keep = 0 if final else _marker_prefix_length(self._pending, END)
        cut = len(self._pending) - keep
        taken, self._pending = self._pending[:cut], self._pending[cut:]
        return taken


def _marker_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (``"a </th"`` -> 4)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ThinkTagParser:
    """The shared parser; a subclass says whether its replies start inside the reasoning section."""

    starts_in_reasoning: ClassVar[bool]

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer  # the markers are text: the tokenizer is not needed to find them

    def streamer(self) -> ThinkTagStreamer:
        return ThinkTagStreamer(self.starts_in_reasoning)

    def extract_reasoning(self, text: str) -> ReasoningSplit:
        streamer = self.streamer()
        reasoning, content = streamer.feed(text, final=True)
        return ReasoningSplit(reasoning if streamer.had_reasoning and reasoning else None, content or None)

    def constrain_content(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        answer = as_structural_format(params)
        thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": END}
        after_reasoning = {"type": "sequence", "elements": [thinking, _GAP, answer]}
        if self.starts_in_reasoning:
            reply = after_reasoning
        else:  # the model may open a reasoning section, or answer straight away
            opened = {"type": "sequence", "elements": [{"type": "const_string", "value": START}, after_reasoning]}
            reply = {"type": "or", "elements": [opened, answer]}
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": reply})
