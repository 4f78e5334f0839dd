"""The OpenAPI schema as served: what only the running engine knows, written in.

FastAPI builds the schema from the request models; two things it cannot know
are filled in here, once, at the first request for it:

- token ids are bounded by the model's vocabulary: fields typed ``TokenId``
  (``minimum: 0`` and the marker below) get ``maximum: vocab_size - 1``, and
  logit_bias keys a pattern of the same range, so a schema-driven client
  (schemathesis) generates only ids the server accepts;
- request validation answers 400 in OpenAI's shape (see ``errors``), never
  FastAPI's 422: its undocumented-elsewhere ``HTTPValidationError`` goes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

# the marker a TokenId field's schema carries (an OpenAPI extension, which clients ignore)
TOKEN_ID_MARKER = "x-token-id"
TOKEN_ID_KEYS_MARKER = "x-token-id-keys"


def install_openapi(app: FastAPI, vocab_size: int) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _bound_token_ids(schema, vocab_size)
            _drop_validation_errors(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARKER, False):
            node["maximum"] = vocab_size - 1
        if node.pop(TOKEN_ID_KEYS_MARKER, False):
            node["propertyNames"] = {"pattern": f"^{number_range_pattern(vocab_size - 1)}$"}
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)


def number_range_pattern(highest: int) -> str:
    """A regular expression matching exactly the decimal numbers 0..``highest`` (no leading zeros)."""
    digits = str(highest)
    alternatives = ["0"] if highest < 10 else ["[0-9]"]
    for length in range(2, len(digits)):  # every number shorter than highest
        alternatives.append(f"[1-9][0-9]{{{length - 1}}}")
    if len(digits) > 1:
        alternatives += _same_length(digits)
    elif highest > 0:
        alternatives = [f"[0-{highest}]"]
    return "(?:" + "|".join(alternatives) + ")"


def _same_length(digits: str) -> list[str]:
    """Numbers of exactly len(digits) digits (no leading zero) that are at most ``digits``."""
    out = []
    for i, digit in enumerate(digits):
        low = 1 if i == 0 else 0
        top = int(digit) - 1
        if top >= low:
            rest = len(digits) - i - 1
            out.append(digits[:i] + f"[{low}-{top}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    out.append(digits)
    return out


def _drop_validation_errors(schema: dict[str, Any]) -> None:
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
