"""Reading JSON that is still being written.

A streamed reply is parsed many times as it grows, so everything here answers
three ways: complete (an index), not yet known (``None``: more text may finish
it) or impossible (:class:`NotJSON`: no continuation can make it fit). Only
structure is checked here (brackets, strings, the call object's keys);
``json.loads`` has the last word on a complete value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_SCALAR_CHARS = frozenset("-+.0123456789eEtruefalsn")
_CLOSERS = {"{": "}", "[": "]"}


class NotJSON(ValueError):
    """The text cannot be (the start of) what was expected, whatever follows."""


def skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in WHITESPACE:
        index += 1
    return index


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value starting at ``text[start]``, or None if ``text`` ends first."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in _CLOSERS:
        return _container_end(text, start)
    if first not in _SCALAR_CHARS:
        raise NotJSON(f"unexpected {first!r} at {start}")
    index = start
    while index < len(text) and text[index] in _SCALAR_CHARS:
        index += 1
    return None if index == len(text) else index  # a number at the very end may still grow


def _string_end(text: str, start: int) -> int | None:
    index = start + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        index += 1
    return None


def _container_end(text: str, start: int) -> int | None:
    expected = [_CLOSERS[text[start]]]
    index = start + 1
    while index < len(text):
        char = text[index]
        if char == '"':
            end = _string_end(text, index)
            if end is None:
                return None
            index = end
            continue
        if char in _CLOSERS:
            expected.append(_CLOSERS[char])
        elif char in "}]":
            if char != expected.pop():
                raise NotJSON(f"mismatched {char!r} at {index}")
            if not expected:
                return index + 1
        index += 1
    return None


@dataclass
class PartialCall:
    """A call object ``{"name": ..., "arguments": {...}}`` read as far as the text goes.

    ``arguments`` is the raw JSON text of the arguments so far (the model's own spacing,
    so streamed pieces concatenate to exactly the final value); ``end`` is the index just
    past the closing brace, once there is one.
    """

    name: str | None = None
    arguments: str = ""
    arguments_done: bool = False
    end: int | None = None

    @property
    def complete(self) -> bool:
        return self.end is not None and self.name is not None and self.arguments_done


def read_call(text: str, start: int, argument_keys: Sequence[str]) -> PartialCall:
    """Read the call object at ``text[start]`` (a ``{``). Keys other than ``name`` and
    ``argument_keys`` make it :class:`NotJSON`: such an object is not a call."""
    call = PartialCall()
    if text[start] != "{":
        raise NotJSON(f"a call starts with '{{', not {text[start]!r}")
    index = skip_whitespace(text, start + 1)
    while index < len(text):
        if text[index] == "}":
            call.end = index + 1
            return call
        if text[index] != '"':
            raise NotJSON(f"expected a key at {index}")
        key_end = value_end(text, index)
        if key_end is None:
            return call
        key = json.loads(text[index:key_end])
        index = skip_whitespace(text, key_end)
        if index == len(text):
            return call
        if text[index] != ":":
            raise NotJSON(f"expected ':' at {index}")
        index = skip_whitespace(text, index + 1)
        if index == len(text):
            return call
        end = _read_field(call, key, text, index, argument_keys)
        if end is None:
            return call
        index = skip_whitespace(text, end)
        if index < len(text) and text[index] == ",":
            index = skip_whitespace(text, index + 1)
        elif index < len(text) and text[index] != "}":
            raise NotJSON(f"expected ',' or '}}' at {index}")
    return call


def _read_field(call: PartialCall, key: str, text: str, start: int, argument_keys: Sequence[str]) -> int | None:
    end = value_end(text, start)
    if key == "name":
        if text[start] != '"':
            raise NotJSON("a call's name is a string")
        if end is not None:
            call.name = json.loads(text[start:end])
        return end
    if key in argument_keys:
        if text[start] != "{":
            raise NotJSON("a call's arguments are an object")
        call.arguments = text[start:len(text) if end is None else end]
        call.arguments_done = end is not None
        return end
    raise NotJSON(f"{key!r} is not a key of a call")


def held_back(text: str, marker: str) -> str:
    """``text`` without its longest suffix that could be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text
