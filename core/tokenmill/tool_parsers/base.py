"""What a tool-call parser is: the records it returns and the protocol it implements.

A parser knows one model family's tool-call syntax (``<tool_call>{...}</tool_call>``,
``{"name": ..., "parameters": ...}``, ...) and does three things with it:

* ``extract(text)``: split a finished reply into content and calls;
* ``streamer()``: the same, incrementally, for one streamed choice;
* ``forced_calls(tools, parallel)``: a structured-output constraint whose language
  is exactly "one or more well-formed calls to these tools", which the server
  applies for ``tool_choice="required"`` or a named function, so the reply always
  parses and its arguments always validate against the tool's schema.

The records are plain dataclasses: the server turns them into OpenAI's JSON and
assigns call ids itself (a parser never needs to invent ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.structured_output.params import StructuredOutputsParams


@dataclass(frozen=True)
class FunctionTool:
    """One function a request offers, as OpenAI's ``tools[i].function`` describes it."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    description: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """A complete call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A finished reply split in two: text for ``message.content`` (None if there is none) and calls."""

    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallPiece:
    """What is new about call ``index`` in one streamed step: its name (the first time it is
    known, exactly once) and/or the next piece of its arguments' JSON text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    """What one streamed step adds: content text and pieces of calls. Concatenating every
    step's content gives ``extract(final_text).content``; every step's arguments for one
    index give that call's arguments."""

    content: str = ""
    calls: list[ToolCallPiece] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.content and not self.calls


class ToolCallStreamer(Protocol):
    """One streamed choice's parse state."""

    def feed(self, text: str, final: bool) -> ToolCallDelta:
        """``text`` is everything generated so far (it only ever grows); ``final`` is set on the
        last call. Returns what is new since the previous call. Text that may still turn out to
        be part of a call is held back until it is known."""


class ToolParser(Protocol):
    """A registered tool-call parser; constructed once per request with the model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None: ...

    def extract(self, text: str) -> ExtractedToolCalls:
        """Content and calls of a finished reply. A reply whose calls do not parse is all content,
        with no calls: a half-parsed call must never reach a client as if it were whole."""

    def streamer(self) -> ToolCallStreamer:
        """A fresh incremental parser for one streamed choice."""

    def forced_calls(self, tools: Sequence[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        """A constraint that admits only calls to ``tools`` in this parser's syntax, whose
        arguments match each tool's parameter schema: at least one call, and exactly one
        unless ``parallel``."""
