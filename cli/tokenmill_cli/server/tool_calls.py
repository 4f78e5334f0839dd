"""Tool calling in chat completions: ``tools``, ``tool_choice``, and replies turned into
``message.tool_calls`` (or streamed tool-call deltas) by the server's tool-call parser.

``tool_choice`` decides what the parser does:

* ``none``: the reply is content; no parsing.
* ``auto`` (the default when tools are given): the model may call; its reply is parsed.
  Needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``, as in vLLM: a server
  that cannot parse calls must not pretend the model made none.
* ``required`` or ``{"type": "function", "function": {"name": ...}}``: the reply is
  *forced* by the parser's structured-output constraint to be one or more calls (one,
  to that function, when named; one when ``parallel_tool_calls`` is false), so it always
  parses and its arguments always match the tool's parameter schema.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

from tokenmill.errors import InvalidRequestError
from tokenmill.tool_parsers import FunctionTool, ToolCallStreamer, ToolParser, load_tool_parser
from tokenmill_cli.server.response_format import Constraint
from tokenmill_cli.server.responses import (
    ChatResponseMessage,
    ChatToolCall,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
)

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode
    name: str | None = None  # the function, when mode is "named"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@cache
def parser_class(name: str) -> type[ToolParser]:
    """The registered parser ``name`` (imported once per process)."""
    return load_tool_parser(name)


def parse_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """OpenAI's ``tools`` list (function tools only) as ``FunctionTool``s; a malformed one is a 400."""
    parsed = []
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}',
                                      param="tools")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{index}].function.name must be a non-empty string", param="tools")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON schema object",
                                      param="tools")
        parsed.append(FunctionTool(name, parameters or {"type": "object"}, function.get("description")))
    names = [tool.name for tool in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools have duplicate function names", param="tools")
    return parsed


def parse_tool_choice(value: Any, tools: list[FunctionTool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice = ToolChoice("named", value["function"].get("name"))
        if choice.name not in {tool.name for tool in tools}:
            raise InvalidRequestError(f"tool_choice names {choice.name!r}, which is not one of the tools",
                                      param="tool_choice")
    else:
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                  '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if choice.mode != "none" and not tools:
        raise InvalidRequestError(f"tool_choice {choice.mode!r} needs tools", param="tool_choice")
    return choice


@dataclass
class ChatTools:
    """One chat request's tool calling: the choice, the parser, and the replies it reads."""

    choice: ToolChoice
    tools: list[FunctionTool] = field(default_factory=list)
    parser: ToolParser | None = None  # None: replies are plain content
    parallel: bool = True
    streams: dict[int, _ChoiceStream] = field(default_factory=dict)

    @classmethod
    def of_request(cls, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool,
                   parser_name: str | None, enable_auto: bool, tokenizer: Any) -> ChatTools:
        parsed = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, parsed)
        if choice.mode == "none":
            return cls(choice, parsed)
        if parser_name is None:
            raise InvalidRequestError(f"tool_choice {choice.mode!r} needs a server started with --tool-call-parser",
                                      param="tool_choice")
        if choice.mode == "auto" and not enable_auto:
            raise InvalidRequestError('"auto" tool choice needs a server started with --enable-auto-tool-choice '
                                      "(and --tool-call-parser); or ask for \"required\", a named function or "
                                      '"none"', param="tool_choice")
        return cls(choice, parsed, parser_class(parser_name)(tokenizer), parallel_tool_calls)

    def constraint(self) -> Constraint | None:
        """The forcing constraint of ``required`` / a named function (None otherwise)."""
        if self.parser is None or not self.choice.forced:
            return None
        tools = [t for t in self.tools if t.name == self.choice.name] if self.choice.mode == "named" else self.tools
        return Constraint(self.parser.forced_calls(tools, self.parallel and self.choice.mode == "required"), "tools")

    # -- whole replies ----------------------------------------------------------------------
    def reply(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """The message for a finished reply, and its finish reason (``tool_calls`` when it called)."""
        if self.parser is None:
            return ChatResponseMessage(content=text), finish_reason
        extracted = self.parser.extract(text)
        if not extracted.calls:
            return ChatResponseMessage(content=extracted.content), finish_reason
        calls = [ChatToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in extracted.calls]
        return ChatResponseMessage(content=extracted.content, tool_calls=calls), _called(finish_reason)

    # -- streamed replies -------------------------------------------------------------------
    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        """The delta for new text ``text`` of choice ``index`` (empty when the parser holds it back)."""
        if self.parser is None:
            return DeltaMessage(content=text or None), finish_reason
        stream = self.streams.setdefault(index, _ChoiceStream(self.parser.streamer()))
        message = stream.advance(text, finish_reason is not None)
        return message, _called(finish_reason) if stream.call_ids else finish_reason


@dataclass
class _ChoiceStream:
    streamer: ToolCallStreamer
    text: str = ""
    call_ids: list[str] = field(default_factory=list)

    def advance(self, text: str, final: bool) -> DeltaMessage:
        self.text += text
        delta = self.streamer.feed(self.text, final)
        calls = []
        for piece in delta.calls:
            if piece.name is not None:  # a new call: its id, type and name go out once
                self.call_ids.append(new_call_id())
                calls.append(DeltaToolCall(index=piece.index, id=self.call_ids[piece.index], type="function",
                                           function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments)))
            else:
                calls.append(DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments)))
        return DeltaMessage(content=delta.content or None, tool_calls=calls or None)


def _called(finish_reason: str | None) -> str | None:
    """A reply that ended normally in calls ends with ``tool_calls``; a cut-off one keeps ``length``."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_constraint(tools: ChatTools, requested: Constraint | None) -> Constraint | None:
    """The request's one constraint: a forced call's, or what response_format / structured_outputs ask."""
    forced = tools.constraint()
    if forced is not None and requested is not None:
        raise InvalidRequestError(f"tool_choice {tools.choice.mode!r} forces the reply's format; it cannot be "
                                  f"combined with {requested.source}", param="tool_choice")
    return forced or requested
