"""The Messages API's event stream: one reply's deltas as Anthropic's events.

Each event is an SSE ``event: <type>`` line plus its JSON: ``message_start`` (the message with no
content), a ``ping``, then per content block ``content_block_start``, ``content_block_delta``...
(``thinking_delta``, ``text_delta`` or a tool call's ``input_json_delta``) and
``content_block_stop``; a new block closes the one before. ``message_delta`` carries the stop
reason and the usage, ``message_stop`` ends the stream; an error after the start is an ``error``
event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tokenmill_cli.server.messages_objects import (
    AnthropicError,
    MessageObject,
    MessagesUsage,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolUseContent,
    tool_use_id,
)
from tokenmill_cli.server.responses import DeltaToolCall


def sse(type: str, **fields: Any) -> str:
    payload = {"type": type, **{k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}}
    return f"event: {type}\ndata: {json.dumps(payload)}\n\n"


def error_event(error: AnthropicError) -> str:
    return f"event: error\ndata: {error.model_dump_json()}\n\n"


@dataclass
class BlockEvents:
    """The content blocks of one streamed reply, and the events that build them up.

    ``thinking``, ``text`` and ``call`` take what chat's streaming reads from the reply (reasoning
    and content text, tool-call pieces from the tool-call parser); ``close`` ends the last block.
    """

    _open: str | None = None  # the open block's kind
    _index: int = -1
    _calls: dict[int, int] = field(default_factory=dict)  # tool-call index -> its block's index

    def start(self, message: MessageObject) -> list[str]:
        return [sse("message_start", message=message), sse("ping")]

    def thinking(self, delta: str) -> list[str]:
        events = [] if self._open == "thinking" else self._start("thinking", ThinkingContent(thinking=""))
        return [*events, self._delta({"type": "thinking_delta", "thinking": delta})]

    def text(self, delta: str) -> list[str]:
        events = [] if self._open == "text" else self._start("text", TextContent(text=""))
        return [*events, self._delta({"type": "text_delta", "text": delta})]

    def call(self, piece: DeltaToolCall) -> list[str]:
        events = []
        if piece.id is not None:  # the first piece of a call: its id and name
            events += self._start("tool_use", ToolUseContent(id=tool_use_id(piece.id), name=piece.function.name or "",
                                                             input={}))
            self._calls[piece.index] = self._index
        if piece.function.arguments:
            index = self._calls[piece.index]
            events.append(sse("content_block_delta", index=index,
                              delta={"type": "input_json_delta", "partial_json": piece.function.arguments}))
        return events

    def close(self, stop_reason: StopReason | None, stop_sequence: str | None, usage: MessagesUsage) -> list[str]:
        return [*self._stop(), sse("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   usage=usage), sse("message_stop")]

    def _start(self, kind: str, block: BaseModel) -> list[str]:
        events = self._stop()
        self._index += 1
        self._open = kind
        return [*events, sse("content_block_start", index=self._index, content_block=block)]

    def _delta(self, delta: dict[str, str]) -> str:
        return sse("content_block_delta", index=self._index, delta=delta)

    def _stop(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [sse("content_block_stop", index=self._index)]
