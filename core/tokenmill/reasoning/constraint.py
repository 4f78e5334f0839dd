"""A constraint as one node of a structural tag, so it can follow a reasoning section.

Structured output on a reasoning model constrains the answer, not the thinking before it. The
grammar therefore covers the whole reply: the reasoning section as free text up to its end marker,
then the request's constraint. Structural tags (xgrammar's format, the one tool-call parsers
already use to force calls) compose such sequences; this turns any ``StructuredOutputsParams``
into the node that goes last.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.structured_output.params import StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


def as_structural_format(params: StructuredOutputsParams) -> dict[str, Any]:
    """``params`` as a structural-tag format node (``{"type": "json_schema", ...}``, ``regex``, ...).

    ``disable_any_whitespace`` has no equivalent inside a structural tag: JSON regions get the
    bounded whitespace runs the backend gives every structural tag."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = _ANY_OBJECT if params.json_object else params.json
        return {"type": "json_schema", "json_schema": json.loads(schema) if isinstance(schema, str) else schema}
    if kind == "regex":
        return {"type": "regex", "pattern": params.regex}
    if kind == "grammar":
        return {"type": "grammar", "grammar": params.grammar}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in params.choice or []]}
    tag = json.loads(params.structural_tag) if isinstance(params.structural_tag, str) else params.structural_tag
    assert isinstance(tag, dict)
    return tag["format"] if tag.get("type") == "structural_tag" and "format" in tag else tag
