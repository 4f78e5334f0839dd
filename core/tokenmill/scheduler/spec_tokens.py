"""The scheduler's side of speculative decoding: which draft tokens a request may carry into
its next step, and what verifying them did.

A request in decode has ``num_tokens - num_computed_tokens == 1`` (its last sampled token);
with drafts it schedules ``1 + len(drafts)`` tokens, which the token budget counts and
``allocate_slots`` gives KV slots. After the step, the drafts the target rejected are taken
back off ``num_computed_tokens``, so ``cache_blocks`` never publishes a speculative token, and
the blocks that held only rejected drafts go back to the pool (``KVCacheManager.free_excess``;
the workers cut their block tables to ``CachedRequestData.num_kept_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.request import Request

if TYPE_CHECKING:
    from tokenmill.structured_output.backend import GrammarMatcher


def usable_drafts(request: Request, proposed: list[int], max_model_len: int) -> list[int]:
    """The drafts worth verifying: no more than the request's length limits leave room to
    accept (the token after the last accepted draft is sampled too, so ``max_tokens - 1``
    drafts at most), and for a request with a grammar, those before the first one the grammar
    forbids (its matcher is rolled back to where it was)."""
    if request.pooling is not None:
        return []
    room = min(request.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens)
    drafts = proposed[: max(0, room)]
    if request.grammar is not None and drafts:
        drafts = drafts[: grammar_valid_prefix(request.grammar, drafts)]
    return drafts


def grammar_valid_prefix(matcher: GrammarMatcher, tokens: list[int]) -> int:
    """How many leading ``tokens`` the grammar accepts, one after the other; the matcher ends
    where it started."""
    accepted = 0
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_tokens([token]):
            break
        accepted += 1
    matcher.rollback(accepted)
    return accepted


@dataclass
class SpecDecodeCounters:
    """Since start: verifying steps, draft tokens verified, and accepted (also per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


def num_rejected(drafts: list[int], sampled: list[int]) -> int:
    """Drafts the target did not accept: it returns the accepted ones and one token more."""
    return len(drafts) + 1 - len(sampled)
