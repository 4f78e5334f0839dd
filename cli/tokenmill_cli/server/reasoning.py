"""Reasoning output in chat completions: a reply's reasoning section split off by the server's
reasoning parser (``--reasoning-parser``) into ``message.reasoning_content`` (and ``reasoning``,
vLLM's newer name), streamed as its own deltas; everything else (tool-call parsing,
``message.content``) sees only what follows the section.

A constraint (``response_format``, ``structured_outputs``, a forced tool call) is for the answer:
the parser moves it past the reasoning section, so the thinking stays free.

The same splitting serves the Responses API's reasoning items: :meth:`ReplyReasoning.split` for a
whole reply, :meth:`ReplyReasoning.delta` for one streamed output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from tokenmill.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreamer,
    load_reasoning_parser,
)
from tokenmill_cli.server.response_format import Constraint


@cache
def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The registered parser ``name`` (imported once per process); an unknown name lists the known ones."""
    return load_reasoning_parser(name)


@dataclass
class ReplyReasoning:
    """One request's reasoning split: the parser (None: no reasoning, every reply is content) and
    the streamed choices' parse states."""

    parser: ReasoningParser | None = None
    streamers: dict[int, ReasoningStreamer] = field(default_factory=dict)

    @classmethod
    def of_server(cls, parser_name: str | None, tokenizer: Any) -> ReplyReasoning:
        return cls(reasoning_parser_class(parser_name)(tokenizer) if parser_name is not None else None)

    def constrain(self, constraint: Constraint | None) -> Constraint | None:
        """The request's constraint, applied after the reasoning section (unchanged without a parser)."""
        if constraint is None or self.parser is None:
            return constraint
        return Constraint(self.parser.constrain_content(constraint.params), constraint.source)

    def split(self, text: str) -> ReasoningSplit:
        """A finished reply's reasoning (None if it has none) and content."""
        if self.parser is None:
            return ReasoningSplit(None, text)
        return self.parser.extract_reasoning(text)

    def delta(self, index: int, text: str, final: bool) -> ReasoningDelta:
        """The new reasoning and content in ``text``, the next piece of output ``index``."""
        if self.parser is None:
            return ReasoningDelta("", text)
        streamer = self.streamers.setdefault(index, self.parser.streamer())
        return streamer.feed(text, final)
