"""What a reasoning parser is: the records it returns and the protocol it implements.

A reasoning model writes a section of thinking before its answer (``<think>...</think>``
for DeepSeek-R1 and Qwen3). A parser knows one family's markers and does three things:

* ``extract_reasoning(text)``: split a finished reply into its reasoning and its content;
* ``streamer()``: the same, incrementally, for one streamed choice;
* ``constrain_content(params)``: turn a constraint meant for the *answer* (a JSON schema,
  a regex, a forced tool call) into one for the whole reply, which leaves the reasoning
  section free and applies ``params`` only after it.

Everything downstream (tool-call parsing, ``message.content``) reads the content only.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from tokenmill.structured_output.params import StructuredOutputsParams


class ReasoningSplit(NamedTuple):
    """A finished reply in two: the reasoning (None when the reply has none) and the content
    (None when nothing follows the reasoning)."""

    reasoning: str | None
    content: str | None


class ReasoningDelta(NamedTuple):
    """What one streamed step adds to the reasoning and to the content. Concatenating every
    step's parts gives ``extract_reasoning(final_text)`` (with ``""`` for ``None``)."""

    reasoning: str = ""
    content: str = ""


class ReasoningStreamer(Protocol):
    """One streamed choice's parse state."""

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        """``delta`` is the text generated since the previous call; ``final`` is set on the last
        call. Returns what is new in each part. Text that may still turn out to be a marker
        (``</thi``) is held back until it is known, and given out at the latest when ``final``."""


class ReasoningParser(Protocol):
    """A registered reasoning parser; constructed once per request with the model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None: ...

    def extract_reasoning(self, text: str) -> ReasoningSplit:
        """The reasoning and the content of a finished reply; the markers belong to neither."""

    def streamer(self) -> ReasoningStreamer:
        """A fresh incremental parser for one streamed choice."""

    def constrain_content(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """A constraint on the whole reply: a reasoning section as this parser reads it, unconstrained,
        then text matching ``params`` (see :func:`tokenmill.plugin_api.as_structural_format`)."""
