"""What a request constrains its output to: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extra, as one ``StructuredOutputsParams``.

The engine names a bad schema by its own parameter (``structured_outputs.json``);
a client that sent ``response_format`` (or ``tools``) should see *that* field in
the 400, so a constraint remembers which request field it came from and
:func:`naming_errors` renames the engine's errors accordingly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output import StructuredOutputsParams

T = TypeVar("T")

_ENGINE_PARAM = "structured_outputs"


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    source: str  # the request field that asked for it: errors about it name this field


def request_constraint(structured_outputs: dict[str, Any] | None,
                       response_format: dict[str, Any] | None = None) -> Constraint | None:
    """The constraint of ``structured_outputs`` or ``response_format``; asking for both is a 400."""
    from_format = response_format_constraint(response_format)
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise InvalidRequestError("give response_format or structured_outputs, not both", param=_ENGINE_PARAM)
    return Constraint(StructuredOutputsParams.from_dict(structured_outputs), _ENGINE_PARAM)


def response_format_constraint(response_format: dict[str, Any] | None) -> Constraint | None:
    """``{"type": "text"}`` (or nothing): none; ``json_object``: any JSON object;
    ``json_schema``: ``json_schema.schema`` (a missing schema allows any object, as in vLLM)."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format json_schema needs a json_schema object "
                                      '({"name": ..., "schema": {...}})', param="response_format.json_schema")
        schema = spec.get("schema")
        if schema is None:
            return Constraint(StructuredOutputsParams(json_object=True), "response_format")
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                      param="response_format.json_schema.schema")
        return Constraint(StructuredOutputsParams(json=schema), "response_format.json_schema.schema")
    raise InvalidRequestError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                              param="response_format.type")


async def naming_errors(outputs: AsyncIterator[T], constraint: Constraint | None) -> AsyncIterator[T]:
    """``outputs``, with the engine's errors about the constraint renamed to the request field it came from."""
    try:
        async for output in outputs:
            yield output
    except InvalidRequestError as exc:
        param = exc.param or ""
        if constraint is None or constraint.source == _ENGINE_PARAM or not param.startswith(_ENGINE_PARAM):
            raise
        raise InvalidRequestError(str(exc).replace(param, constraint.source), param=constraint.source) from exc
    finally:  # closing this closes the engine's stream too (which aborts its request if unfinished)
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()
