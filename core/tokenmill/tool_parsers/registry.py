"""Tool-call parsers by name, from the plugins' ``tokenmill_register_tool_parsers`` answers."""

from __future__ import annotations

from tokenmill.plugins.named_classes import NamedClasses
from tokenmill.tool_parsers.base import ToolParser

TOOL_PARSERS: NamedClasses[ToolParser] = NamedClasses(
    "tokenmill_register_tool_parsers", "tool-call parser", "tool_call_parser", "tokenmill-tool-parsers")
tool_parser_names = TOOL_PARSERS.names
load_tool_parser = TOOL_PARSERS.load
