"""Encoder outputs kept by content hash, within a budget of embedding rows."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """Least-recently-used encoder outputs, at most ``budget`` rows (tokens) in all.

    An output larger than the whole budget is not kept: the item is encoded again for
    each step that needs a part of it (a cache too small still gives right answers, only
    slower). ``queries`` counts look-ups, ``hits`` the ones answered from the cache and
    ``encoded`` the items the encoder ran for: what the metrics and the tests read.
    """

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"the encoder cache budget must be at least 0 tokens, got {budget}")
        self.budget = budget
        self._outputs: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.queries = 0
        self.hits = 0
        self.encoded = 0

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def used(self) -> int:
        """Rows held now."""
        return self._rows

    def get(self, key: str) -> torch.Tensor | None:
        self.queries += 1
        output = self._outputs.get(key)
        if output is not None:
            self.hits += 1
            self._outputs.move_to_end(key)
        return output

    def pop(self, key: str) -> None:
        """Drop ``key``'s output, if held (the scheduler's mirror evicted it)."""
        output = self._outputs.pop(key, None)
        if output is not None:
            self._rows -= int(output.shape[0])

    def put(self, key: str, output: torch.Tensor) -> None:
        """Keep ``output`` (``[rows, hidden]``), evicting the least recently used ones to make room."""
        rows = int(output.shape[0])
        if rows > self.budget or key in self._outputs:
            return
        while self._rows + rows > self.budget:
            _, evicted = self._outputs.popitem(last=False)
            self._rows -= int(evicted.shape[0])
        self._outputs[key] = output
        self._rows += rows
