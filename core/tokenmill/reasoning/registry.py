"""Reasoning parsers by name, from the plugins' ``tokenmill_register_reasoning_parsers`` answers."""

from __future__ import annotations

from tokenmill.plugins.named_classes import NamedClasses
from tokenmill.reasoning.base import ReasoningParser

REASONING_PARSERS: NamedClasses[ReasoningParser] = NamedClasses(
    "tokenmill_register_reasoning_parsers", "reasoning parser", "reasoning_parser", "tokenmill-reasoning-parsers")
reasoning_parser_names = REASONING_PARSERS.names
load_reasoning_parser = REASONING_PARSERS.load
