"""What JSON-call parsers share: calls are JSON objects ``{"name": ..., <arguments key>: {...}}``
framed by some syntax (tags, separators). A parser only says how its text splits into content
and calls (:meth:`JsonCallParser.snapshot`) and how one call is framed; extraction, streaming
and the forcing constraint follow from that, so the three can never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenmill import StructuredOutputsParams
from tokenmill.plugin_api import ExtractedToolCalls, FunctionTool, ToolCall, ToolCallDelta, ToolCallPiece
from tokenmill_tool_parsers.json_scan import PartialCall


@dataclass
class Snapshot:
    """A reply read so far. ``content`` is stable: as the text grows, it only grows."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class JsonCallParser:
    """Base of parsers whose calls are JSON objects; subclasses define the framing."""

    #: keys a call's arguments may come under (the first is what forced calls use)
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments",)
    #: what goes between two calls of a forced reply
    separator: ClassVar[str] = "\n"

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    # -- what a subclass defines --------------------------------------------------------
    def snapshot(self, text: str, final: bool) -> Snapshot:
        """Split ``text`` into content and calls; unless ``final``, hold back what may yet be a call."""
        raise NotImplementedError

    def call_frame(self, tool: FunctionTool) -> tuple[str, str]:
        """The text before and after a call's arguments object in a forced reply."""
        raise NotImplementedError

    # -- what follows ----------------------------------------------------------------------
    def extract(self, text: str) -> ExtractedToolCalls:
        snap = self.snapshot(text, final=True)
        if not snap.calls:
            return ExtractedToolCalls(snap.content or None, [])
        if not all(call.complete and _is_object(call.arguments) for call in snap.calls):
            return ExtractedToolCalls(text, [])  # a broken call is never passed on as a call
        calls = [ToolCall(str(call.name), call.arguments) for call in snap.calls]
        return ExtractedToolCalls(snap.content or None, calls)

    def streamer(self) -> SnapshotStreamer:
        return SnapshotStreamer(self.snapshot)

    def forced_calls(self, tools: Sequence[FunctionTool], parallel: bool) -> StructuredOutputsParams:
        tags = []
        for tool in tools:
            begin, end = self.call_frame(tool)
            tags.append({"type": "tag", "begin": begin, "end": end,
                         "content": {"type": "json_schema", "json_schema": tool.parameters or {"type": "object"}}})
        # xgrammar's structural tag: one or more tagged calls, each region a JSON schema
        tag_format = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                      "at_least_one": True, "stop_after_first": not parallel}
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": tag_format})


def call_prefix(name: str, arguments_key: str) -> str:
    """``{"name": "NAME", "arguments": `` as models write it (json.dumps' spacing)."""
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, {json.dumps(arguments_key)}: '


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


@dataclass
class SnapshotStreamer:
    """Streams the difference between successive snapshots of one choice."""

    snapshot: Callable[[str, bool], Snapshot]
    sent_content: int = 0
    announced: int = 0  # calls whose name has been sent
    sent_arguments: list[int] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> ToolCallDelta:
        snap = self.snapshot(text, final)
        content = snap.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(snap.content))
        pieces = []
        for index, call in enumerate(snap.calls):
            if index >= self.announced:
                if call.name is None:
                    break  # a call is announced by name first; its arguments wait for it
                self.announced += 1
                self.sent_arguments.append(0)
                name: str | None = call.name
            else:
                name = None
            arguments = call.arguments[self.sent_arguments[index]:]
            self.sent_arguments[index] += len(arguments)
            if name is not None or arguments:
                pieces.append(ToolCallPiece(index, name, arguments))
        return ToolCallDelta(content, pieces)
