"""The Responses API's event stream: one reply's deltas as OpenAI's semantic events.

Each event is an SSE ``event: <type>`` line plus its JSON, numbered by ``sequence_number``.
An output item opens with ``response.output_item.added`` and closes with
``response.output_item.done``; in between, a message has one ``output_text`` part
(``response.content_part.added``, ``response.output_text.delta``..., ``.done``,
``response.content_part.done``), a reasoning item its text (``response.reasoning_text.delta``...,
``.done``) and a function call its arguments (``response.function_call_arguments.delta``..., ``.done``). Items follow each other:
a new one closes the one before. There is no ``[DONE]``: the stream ends with
``response.completed``, ``response.incomplete`` or ``response.failed``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tokenmill_cli.server.responses import DeltaToolCall
from tokenmill_cli.server.responses_objects import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    new_item_id,
)


@dataclass
class EventWriter:
    """Numbers the events and writes them as SSE."""

    sequence_number: int = 0

    def event(self, type: str, **fields: Any) -> str:
        payload = {"type": type, "sequence_number": self.sequence_number,
                   **{k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}}
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(payload)}\n\n"


@dataclass
class OutputEvents:
    """The output items of one streamed reply, and the events that build them up.

    ``reasoning``, ``text`` and ``call`` take what chat's streaming reads from the reply (reasoning
    and content text, tool-call pieces from the tool-call parser); ``close`` ends the last item.
    """

    writer: EventWriter
    items: list[OutputItem] = field(default_factory=list)
    _open: OutputItem | None = None
    _calls: dict[int, OutputFunctionCall] = field(default_factory=dict)  # tool-call index -> its item

    def text(self, delta: str) -> list[str]:
        events = []
        if not isinstance(self._open, OutputMessage):
            events += self._open_item(OutputMessage(id=new_item_id("msg"), status="in_progress", content=[]))
            assert isinstance(self._open, OutputMessage)
            events.append(self._content_part("response.content_part.added", self._open, OutputText(text="")))
            self._open.content.append(OutputText(text=""))
        message = self._open
        if delta:
            message.content[0].text += delta
            events.append(self.writer.event("response.output_text.delta", item_id=message.id,
                                            output_index=self._index(), content_index=0, delta=delta, logprobs=[]))
        return events

    def reasoning(self, delta: str) -> list[str]:
        events = []
        if not isinstance(self._open, OutputReasoning):
            events += self._open_item(OutputReasoning(id=new_item_id("rs"), status="in_progress",
                                                      content=[ReasoningText(text="")]))
        item = self._open
        assert isinstance(item, OutputReasoning)
        item.content[0].text += delta
        events.append(self.writer.event("response.reasoning_text.delta", item_id=item.id,
                                        output_index=self._index(), content_index=0, delta=delta))
        return events

    def call(self, piece: DeltaToolCall) -> list[str]:
        events = []
        if piece.id is not None:  # the first piece of a call: its id and name
            item = OutputFunctionCall(id=new_item_id("fc"), call_id=piece.id, name=piece.function.name or "",
                                      arguments="", status="in_progress")
            events += self._open_item(item)
            self._calls[piece.index] = item
        item = self._calls[piece.index]
        if piece.function.arguments:
            item.arguments += piece.function.arguments
            events.append(self.writer.event("response.function_call_arguments.delta", item_id=item.id,
                                            output_index=self.items.index(item), delta=piece.function.arguments))
        return events

    def close(self, status: ItemStatus) -> list[str]:
        """End the stream's output: the last item closes with ``status``; a reply with neither a
        message nor a call (nothing, or reasoning only) still has its (empty) message, as the whole
        response would."""
        answered = any(isinstance(item, OutputMessage | OutputFunctionCall) for item in self.items)
        events = [] if answered else self.text("")
        return events + self._close_open(status)

    def _open_item(self, item: OutputItem) -> list[str]:
        events = self._close_open("completed")
        self.items.append(item)
        self._open = item
        events.append(self.writer.event("response.output_item.added", output_index=self._index(), item=item))
        return events

    def _close_open(self, status: ItemStatus) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(self.writer.event("response.output_text.done", item_id=item.id, output_index=index,
                                            content_index=0, text=part.text, logprobs=[]))
            events.append(self._content_part("response.content_part.done", item, part, index))
        elif isinstance(item, OutputReasoning):
            events.append(self.writer.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                            content_index=0, text=item.content[0].text))
        else:
            events.append(self.writer.event("response.function_call_arguments.done", item_id=item.id,
                                            output_index=index, name=item.name, arguments=item.arguments))
        item.status = status
        events.append(self.writer.event("response.output_item.done", output_index=index, item=item))
        return events

    def _content_part(self, type: str, message: OutputMessage, part: OutputText, index: int | None = None) -> str:
        return self.writer.event(type, item_id=message.id, output_index=self._index() if index is None else index,
                                 content_index=0, part=part)

    def _index(self) -> int:
        return len(self.items) - 1
