"""Llama 3.x JSON tool calls: the reply *is* the call, ``{"name": ..., "parameters": {...}}``,
several separated by ``;``, optionally after ``<|python_tag|>``. A reply that does not start
that way is plain content."""

from __future__ import annotations

from tokenmill.plugin_api import FunctionTool
from tokenmill_tool_parsers.json_calls import JsonCallParser, Snapshot, call_prefix
from tokenmill_tool_parsers.json_scan import NotJSON, PartialCall, read_call, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(JsonCallParser):
    argument_keys = ("parameters", "arguments")
    separator = "; "

    def call_frame(self, tool: FunctionTool) -> tuple[str, str]:
        return call_prefix(tool.name, "parameters"), "}"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return Snapshot()  # nothing yet, or the tag still being written
        if start == len(text) or text[start] != "{":
            return Snapshot(text if final or start < len(text) else "")
        calls: list[PartialCall] = []
        position = start
        while True:
            try:
                call = read_call(text, position, self.argument_keys)
            except NotJSON:
                if not calls:  # JSON, but not a call: the reply is content
                    return Snapshot(text)
                break  # text after the calls is dropped, as it would be by a JSON decoder
            calls.append(call)
            if call.end is None:
                break
            after = skip_whitespace(text, call.end)
            if after == len(text) or text[after] != ";":
                break
            position = skip_whitespace(text, after + 1)
            if position == len(text) or text[position] != "{":
                break
        return Snapshot("", calls)
