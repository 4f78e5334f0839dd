"""Engine logprobs -> OpenAI's two layouts (legacy completions, chat).

The engine gives, per token, ``{token_id: Logprob}`` holding the chosen
token (with its true rank) and the top-k alternatives (ranks 1..k).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.outputs import Logprob
from tokenmill_cli.server.responses import CompletionLogprobs, PromptLogprob, PromptLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf; OpenAI's servers answer with a large negative number instead
_FLOOR = -9999.0

TokenLogprobs = dict[int, Logprob] | None


def padded_logprobs(logprobs: Sequence[TokenLogprobs] | None, length: int) -> list[TokenLogprobs]:
    """Exactly ``length`` entries: positions the engine gave nothing for (the first prompt token) are None."""
    entries = list(logprobs or [])[-length:] if length else []
    return [None] * (length - len(entries)) + entries


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


def _text(tokenizer: Any, token_id: int, logprob: Logprob | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                        text_offset: int) -> CompletionLogprobs:
    """Parallel lists; ``top_logprobs`` also holds the chosen token, so up to k + 1 entries.

    A position without logprobs (the first prompt token under ``echo``) has None.
    """
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        chosen = entry.get(token_id) if entry else None
        token = _text(tokenizer, token_id, chosen)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        out.token_logprobs.append(None if chosen is None else _value(chosen.logprob))
        out.top_logprobs.append(None if not entry else _top_dict(tokenizer, entry))
    return out


def _top_dict(tokenizer: Any, entry: dict[int, Logprob]) -> dict[str, float]:
    """Keyed by token text: tokens that decode alike (partial UTF-8 bytes all read "\ufffd") keep the likeliest."""
    top: dict[str, float] = {}
    for token_id, logprob in sorted(entry.items(), key=lambda item: -item[1].logprob):
        top.setdefault(_text(tokenizer, token_id, logprob), _value(logprob.logprob))
    return top


def merge_completion_logprobs(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for part in parts:
        out.tokens += part.tokens
        out.token_logprobs += part.token_logprobs
        out.top_logprobs += part.top_logprobs
        out.text_offset += part.text_offset
    return out


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                  num_top: int) -> list[TokenLogprob]:
    """One entry per token: the chosen token and exactly the ``num_top`` likeliest, best first."""
    out = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        entry = entry or {}
        chosen = entry.get(token_id)
        token = _text(tokenizer, token_id, chosen)
        ranked = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top)
        top = [_top(tokenizer, t, lp) for _, t, lp in ranked]
        out.append(TokenLogprob(token=token, logprob=_FLOOR if chosen is None else _value(chosen.logprob),
                                bytes=list(token.encode()), top_logprobs=top))
    return out


def _top(tokenizer: Any, token_id: int, logprob: Logprob) -> TopLogprob:
    token = _text(tokenizer, token_id, logprob)
    return TopLogprob(token=token, logprob=_value(logprob.logprob), bytes=list(token.encode()))


def prompt_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None,
                    ) -> PromptLogprobs:
    """vLLM's layout: one entry per prompt token (None for the first), keyed by token id."""
    return [None if not entry else
            {str(t): PromptLogprob(logprob=_value(lp.logprob), rank=lp.rank, decoded_token=_text(tokenizer, t, lp))
             for t, lp in entry.items()}
            for entry in padded_logprobs(logprobs, len(token_ids))]
