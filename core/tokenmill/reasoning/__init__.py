"""Reasoning output: the interface a reasoning parser plugin implements, and finding one by name.

Parsers are registered through ``tokenmill_register_reasoning_parsers`` (``{name: "module:Class"}``)
and imported only when a server picks one (``tokenmill serve --reasoning-parser NAME``).
"""

from tokenmill.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningSplit, ReasoningStreamer
from tokenmill.reasoning.constraint import as_structural_format
from tokenmill.reasoning.registry import load_reasoning_parser, reasoning_parser_names

__all__ = [
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStreamer",
    "as_structural_format",
    "load_reasoning_parser",
    "reasoning_parser_names",
]
