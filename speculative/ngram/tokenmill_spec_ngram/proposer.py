"""Prompt lookup: find the context's last ``n`` tokens earlier in the context (prompt and
output so far), longest ``n`` first from ``prompt_lookup_max`` down to ``prompt_lookup_min``,
and propose the tokens that followed the most recent earlier occurrence (repeating them
periodically where the occurrence is so recent that fewer than ``k`` tokens follow it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.plugin_api import DraftRequest, ProposerContext, SpeculativeConfig


def lookup_drafts(tokens: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> np.ndarray:
    """The continuation of the latest earlier match of the longest matching suffix (empty: none).

    One vectorised comparison per ``n``: every window of the context against its suffix.
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length-1-n: each is followed by at least one token, and the
        # suffix itself (starting at length-n) is not among them
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            # Past the context's end the match's continuation is the context itself from
            # ``start``: the text repeats with period ``length - start`` (a loop drafts k tokens,
            # not the one or two left before the end).
            return tokens[start + np.arange(num_drafts) % (length - start)]
    return tokens[:0]


class NgramProposer:
    """Stateless: everything it needs is the request's tokens."""

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [lookup_drafts(r.token_ids, self.min_n, self.max_n, r.num_drafts).tolist() for r in requests]

    def forget(self, req_ids: Iterable[str]) -> None:
        return None
