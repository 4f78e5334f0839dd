"""The Responses API's memory: finished responses kept for ``GET /v1/responses/{id}`` and
``previous_response_id``, in this process only, least recently used first out.

The bound is a count (``--max-stored-responses``), not bytes: every entry is one response
and the conversation that led to it, and a conversation is at most a context's worth of
text (a longer one could not have been generated), so the count bounds the memory too.
Each entry holds its whole conversation rather than a link to its predecessor, so an
evicted ancestor never breaks a chain that is still stored; the items themselves are
shared between the entries of one chain, only the lists are copied.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered (JSON-ready)
    conversation: tuple[Any, ...]  # every input item up to and including this response's output items


class ResponseStore:
    """An LRU map of response id -> :class:`StoredResponse`; a capacity of 0 stores nothing."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if capacity < 0:
            raise ValueError(f"a response store holds 0 or more responses, not {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None if it was never stored or has been evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
