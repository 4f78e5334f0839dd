"""DeepSeek-R1 (and its distills): the chat template opens ``<think>`` in the prompt, so the reply
*starts* in its reasoning section. Everything up to ``</think>`` is reasoning (a leading
``<think>``, which some versions still write, is dropped); a reply without ``</think>`` is all
reasoning (it was cut off while thinking), as vLLM's parser of the same name reads it."""

from __future__ import annotations

from tokenmill_reasoning_parsers.think_tags import ThinkTagParser


class DeepSeekR1ReasoningParser(ThinkTagParser):
    starts_in_reasoning = True
