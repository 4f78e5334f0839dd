"""What a caller asks the output to conform to: vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError

# The constraint kinds, in the order their fields appear; exactly one is set.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

GrammarKey = tuple[str, str, bool]  # (kind, canonical text, disable_any_whitespace)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema, dict or string), ``json_object``
    (any JSON object), ``regex``, ``choice`` (one of these strings) or
    ``grammar`` (EBNF, GBNF style: ``root ::= ...``) or ``structural_tag`` (a
    structured-output backend's own format for tagged regions, e.g. xgrammar's
    ``{"type": "structural_tag", "format": {...}}``, dict or string: what tool-call
    parsers use to force a call in the model's native syntax).

    ``disable_any_whitespace`` makes JSON compact (no free whitespace between
    tokens); by default whitespace is allowed but each run is bounded, so a
    model cannot loop on newlines forever.

    A malformed value raises :class:`InvalidRequestError` here; whether a
    schema, regex or grammar is *valid* is the backend's call, made when the
    request is submitted.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [kind for kind in KINDS if _is_set(getattr(self, kind))]
        if len(chosen) != 1:
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(chosen) if chosen else 'none'}", param="structured_outputs")
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None:
            if isinstance(self.json, str):
                _parse_json_text(self.json, "json")
            elif not isinstance(self.json, dict):
                raise InvalidRequestError("structured_outputs.json must be a JSON schema (a dict or a JSON string)",
                                          param="structured_outputs.json")
        if self.structural_tag is not None:
            tag = _parse_json_text(self.structural_tag, "structural_tag") if isinstance(self.structural_tag, str) \
                else self.structural_tag
            if not isinstance(tag, dict):
                raise InvalidRequestError("structured_outputs.structural_tag must be a JSON object (a dict or a "
                                          "JSON string)", param="structured_outputs.structural_tag")
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidRequestError("structured_outputs.regex must be a string", param="structured_outputs.regex")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequestError("structured_outputs.grammar must be a string",
                                      param="structured_outputs.grammar")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of strings",
                                      param="structured_outputs.choice")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """The JSON form (``{"regex": "[0-9]+"}``), as the server's ``structured_outputs`` extra takes it."""
        if not isinstance(fields, dict):
            raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown fields {unknown}; known: "
                                      f"{sorted(cls.__dataclass_fields__)}", param="structured_outputs")
        return cls(**fields)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if _is_set(getattr(self, kind)))

    @property
    def param(self) -> str:
        """The parameter an error about this constraint names, e.g. ``structured_outputs.regex``."""
        return f"structured_outputs.{self.kind}"

    def key(self) -> GrammarKey:
        """A hashable identity: equal keys compile to the same grammar (the compile cache key)."""
        kind = self.kind
        if kind in ("json", "structural_tag"):
            value = getattr(self, kind)
            value = _parse_json_text(value, kind) if isinstance(value, str) else value
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            text = json.dumps(list(self.choice or []))
        else:
            text = str(getattr(self, kind))
        return kind, text, self.disable_any_whitespace


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def _parse_json_text(text: str, kind: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"structured_outputs.{kind} is not valid JSON: {exc}",
                                  param=f"structured_outputs.{kind}") from exc
