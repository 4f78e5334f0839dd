"""Tool calling: the interface a tool-call parser plugin implements, and finding one by name.

Parsers are registered through ``tokenmill_register_tool_parsers`` (``{name: "module:Class"}``)
and imported only when a server picks one (``tokenmill serve --tool-call-parser NAME``).
"""

from tokenmill.tool_parsers.base import (
    ExtractedToolCalls,
    FunctionTool,
    ToolCall,
    ToolCallDelta,
    ToolCallPiece,
    ToolCallStreamer,
    ToolParser,
)
from tokenmill.tool_parsers.registry import load_tool_parser, tool_parser_names

__all__ = [
    "ExtractedToolCalls",
    "FunctionTool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallPiece",
    "ToolCallStreamer",
    "ToolParser",
    "load_tool_parser",
    "tool_parser_names",
]
