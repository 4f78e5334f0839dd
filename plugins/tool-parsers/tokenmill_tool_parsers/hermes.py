"""The Hermes / Qwen syntax: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
one block per call, free text around them."""

from __future__ import annotations

from tokenmill.plugin_api import FunctionTool
from tokenmill_tool_parsers.json_calls import JsonCallParser, Snapshot, call_prefix
from tokenmill_tool_parsers.json_scan import NotJSON, PartialCall, held_back, read_call, skip_whitespace

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(JsonCallParser):
    argument_keys = ("arguments",)
    separator = "\n"

    def call_frame(self, tool: FunctionTool) -> tuple[str, str]:
        return f"{START}\n{call_prefix(tool.name, 'arguments')}", f"}}\n{END}"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        content: list[str] = []
        calls: list[PartialCall] = []
        position = 0
        while True:
            start = text.find(START, position)
            if start < 0:
                tail = text[position:]
                tail = tail if final else held_back(tail, START).rstrip()  # trailing space may precede a call
                content.append(tail.lstrip() if calls else tail)
                break
            body = skip_whitespace(text, start + len(START))
            try:
                call = read_call(text, body, self.argument_keys) if body < len(text) else PartialCall()
            except NotJSON:  # a tag with no call in it: plain text, from here on
                content.append(text[position:].lstrip() if calls else text[position:])
                break
            segment = text[position:start]
            content.append(segment.strip() if calls else segment.rstrip())
            calls.append(call)
            if call.end is None:
                break
            after = skip_whitespace(text, call.end)
            if text.startswith(END, after):
                position = after + len(END)
            elif not final and END.startswith(text[after:]):
                break  # the end tag is still coming
            else:
                position = after  # a call without its end tag: tolerated, it ends at its brace
        return Snapshot("".join(content), calls)
