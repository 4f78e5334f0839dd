"""Qwen3: the model itself opens its reasoning with ``<think>`` at the start of the reply and
closes it with ``</think>``; a reply that does not start with ``<think>`` (``enable_thinking``
off, or a non-thinking model) has no reasoning and is all content, as vLLM's ``qwen3`` parser
read it before Qwen3.5. For templates that put ``<think>`` in the prompt (Qwen3.5, the
Thinking-2507 models) use ``deepseek_r1``, which reads a reply that starts inside the section."""

from __future__ import annotations

from tokenmill_reasoning_parsers.think_tags import ThinkTagParser


class Qwen3ReasoningParser(ThinkTagParser):
    starts_in_reasoning = False
