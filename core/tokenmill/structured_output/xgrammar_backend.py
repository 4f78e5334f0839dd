"""The default structured-output backend: xgrammar.

Constraints are first parsed into an ``xgrammar.Grammar`` (tokenizer-free and
fast, so it doubles as validation in the submitting thread), then compiled
against the tokenizer (the token-mask tables; the slow part, run off the step
loop). xgrammar is imported on first use: it takes seconds to import.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.params import StructuredOutputsParams

# Free JSON whitespace is bounded per run: with unbounded runs a model (a small
# one especially) can emit newlines until max_tokens and never close the JSON.
MAX_WHITESPACE_RUN = 8

_ANY_OBJECT = {"type": "object"}
_LABELS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
           "grammar": "grammar", "structural_tag": "structural tag"}
# xgrammar's C++ errors start with "[time] /path/file.cc:line: "; the user needs only the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


class XgrammarMatcher:
    """A :class:`~tokenmill.structured_output.backend.GrammarMatcher` over ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        accepted = 0
        for token in token_ids:
            if not self._matcher.accept_token(int(token)):
                if accepted:  # all or nothing: the caller sees the state it had before
                    self._matcher.rollback(accepted)
                return False
            accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XgrammarBackend:
    """A :class:`~tokenmill.structured_output.backend.StructuredOutputBackend` on xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        if tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer, and this model has none",
                                      param="structured_outputs")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def validate(self, params: StructuredOutputsParams) -> None:
        try:
            to_grammar(params)
        except Exception as exc:  # xgrammar raises RuntimeError for every parse error
            message = _CPP_PREFIX.sub("", str(exc)).strip()
            raise InvalidRequestError(f"invalid {_LABELS[params.kind]} in {params.param}: {message}",
                                      param=params.param) from exc

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self._get_compiler().compile_grammar(to_grammar(params))

    def matcher(self, compiled: Any) -> XgrammarMatcher:
        import xgrammar as xgr

        return XgrammarMatcher(xgr.GrammarMatcher(compiled))

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # The model's vocab size, not the tokenizer's: the lm_head may be padded,
                # and the bitmask must cover every logit.
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids or None)
                # Our manager caches compiled grammars by constraint; a second cache would only cost memory.
                self._compiler = xgr.GrammarCompiler(info, max_threads=_num_threads(), cache_enabled=False)
            return self._compiler


def to_grammar(params: StructuredOutputsParams) -> Any:
    """The ``xgrammar.Grammar`` of a constraint (tokenizer-independent); raises on an invalid one."""
    return _GRAMMAR_BUILDERS[params.kind](params)


def _json_grammar(params: StructuredOutputsParams) -> Any:
    import xgrammar as xgr

    schema = _ANY_OBJECT if params.json_object else params.json
    if isinstance(schema, str):
        schema = json.loads(schema)
    any_whitespace = not params.disable_any_whitespace
    return xgr.Grammar.from_json_schema(bounded_strings_as_patterns(schema), any_whitespace=any_whitespace,
                                        max_whitespace_cnt=MAX_WHITESPACE_RUN if any_whitespace else None)


def _regex_grammar(params: StructuredOutputsParams) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_regex(str(params.regex))


def _choice_grammar(params: StructuredOutputsParams) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))


def _ebnf_grammar(params: StructuredOutputsParams) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(str(params.grammar))


def _structural_tag_grammar(params: StructuredOutputsParams) -> Any:
    import xgrammar as xgr

    tag = params.structural_tag
    if isinstance(tag, str):
        tag = json.loads(tag)
    return xgr.Grammar.from_structural_tag(json.dumps(bounded_json_formats(tag)))


_GRAMMAR_BUILDERS = {"json": _json_grammar, "json_object": _json_grammar, "regex": _regex_grammar,
                     "choice": _choice_grammar, "grammar": _ebnf_grammar, "structural_tag": _structural_tag_grammar}


def bounded_json_formats(node: Any) -> Any:
    """The JSON-schema regions of a structural tag get what plain JSON constraints get: bounded
    whitespace runs (xgrammar's default there is unbounded) and the bounded-string rewrite below.
    ``disable_any_whitespace`` has no equivalent here (xgrammar wants a positive bound)."""
    if isinstance(node, list):
        return [bounded_json_formats(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {"max_whitespace_cnt": MAX_WHITESPACE_RUN, **node,
                "json_schema": bounded_strings_as_patterns(node["json_schema"])}
    return {key: bounded_json_formats(value) for key, value in node.items()}


def bounded_strings_as_patterns(schema: Any) -> Any:
    r"""Rewrite ``{"type": "string", "maxLength": n}`` (and ``minLength``) as the same bound in a ``pattern``.

    xgrammar 0.2.9 lowers a length-bounded string to ``[^"\\\r\n]{m,n}``, which admits raw
    control characters (a tab, ``\x06``): invalid JSON that ``json.loads`` rejects
    (mlc-ai/xgrammar#800). Its ``pattern`` path matches JSON string characters and
    excludes them (and, like the length path, emits no escapes). A string that already
    has a pattern is left alone. Remove this once the fix ships in the xgrammar we require.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {key: value if key in _DATA_KEYWORDS else bounded_strings_as_patterns(value)
                 for key, value in schema.items()}
    low, high = rewritten.get("minLength"), rewritten.get("maxLength")
    bounded = isinstance(low, int) or isinstance(high, int)
    if rewritten.get("type") == "string" and bounded and "pattern" not in rewritten and _int_or_none(low, high):
        rewritten.pop("minLength", None)
        rewritten.pop("maxLength", None)
        rewritten["pattern"] = rf"^[\s\S]{{{low or 0},{'' if high is None else high}}}$"
    return rewritten


def _int_or_none(*values: Any) -> bool:
    return all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in values)


# Keywords whose values are JSON data, not subschemas: never rewritten.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def choice_ebnf(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b"``; JSON string escaping is also valid EBNF string-literal escaping."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _num_threads() -> int:
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except AttributeError:  # not on Linux
        return max(1, min(8, os.cpu_count() or 1))
