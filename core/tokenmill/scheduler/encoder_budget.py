"""The scheduler's side of the encoder: a compute budget per step and a mirror of the
workers' encoder cache.

A prefill chunk that reaches an image's placeholder tokens needs that image's encoder output.
Encoding is the step's work too: a step that reached many big images would encode them all and
stall every decode in the batch. So each step may encode at most ``compute_budget`` encoder
input tokens (placeholder rows); a chunk whose next uncached item does not fit what is left is
cut just before that item's placeholder, and the rest of the prompt goes on in a later step.
An item larger than the whole budget is encoded alone, in a step that encodes nothing else (it
never starves; vLLM instead raises the budget at start-up to the model's largest item, which
needs a per-model bound we do not have for dynamic-resolution models).

The mirror knows what the workers' :class:`~tokenmill.multimodal.encoder_cache.EncoderCache`
holds because it decides it: it allocates rows for each item it schedules, pins an item while a
running request still needs its rows, evicts unpinned items least recently used first, and
names the evicted ones in ``SchedulerOutput.free_encoder_hashes`` for the workers to drop
before they encode. With the same capacity on both sides a worker's cache never evicts on its
own, so "in the mirror" means "in every worker's cache". An item larger than the cache is never
kept: every step that reaches a part of it encodes it again (and pays for it in the budget).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.multimodal.inputs import MultiModalItem
from tokenmill.scheduler.whole_items import whole_items_chunk


@dataclass
class _Step:
    """What the step being scheduled encodes."""

    remaining: int
    items: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # request -> (item index, hash)
    keys: set[str] = field(default_factory=set)  # content hashes encoded this step
    tokens: int = 0


class EncoderBudget:
    def __init__(self, compute_budget: int, cache_size: int, whole_items: bool = False) -> None:
        if compute_budget < 1:
            raise ValueError(f"the encoder budget must be at least 1 token, got {compute_budget}")
        self.compute_budget = compute_budget
        self.capacity = cache_size
        self.whole_items = whole_items  # chunks never end inside an item (tokenmill.scheduler.whole_items)
        self._entries: OrderedDict[str, int] = OrderedDict()  # content hash -> rows, least recent first
        self._pins: dict[str, set[str]] = {}  # content hash -> requests that still need it
        self._pinned_rows = 0
        self._freed: list[str] = []
        self._step = _Step(compute_budget)
        self.num_encoder_steps = 0  # steps that encoded anything, since start
        self.num_over_budget_steps = 0  # steps that encoded more than the budget (an oversized item alone)
        self.max_step_tokens = 0  # most encoder input tokens one step encoded
        self.num_encoder_input_tokens = 0  # encoder input tokens scheduled, since start
        # chunks cut short or held back because an item fit neither the step's budget nor the cache
        self.num_deferrals = 0

    # -- one step -------------------------------------------------------
    def begin_step(self) -> None:
        self._step = _Step(self.compute_budget)

    def end_step(self) -> tuple[dict[str, list[int]], list[str]]:
        """The step's items to encode, by request, and the hashes the workers drop first."""
        step, freed = self._step, self._freed
        self._freed = []
        if step.tokens:
            self.num_encoder_steps += 1
            self.num_encoder_input_tokens += step.tokens
            self.max_step_tokens = max(self.max_step_tokens, step.tokens)
            if step.tokens > self.compute_budget:
                self.num_over_budget_steps += 1
        return {req: [index for index, _ in items] for req, items in step.items.items()}, freed

    def fit_chunk(self, req_id: str, items: list[MultiModalItem], start: int, num_new: int) -> int:
        """How many of the ``num_new`` tokens from ``start`` the step can take: all, or up to the
        first item they reach whose encoder output neither exists nor fits the step's budget and
        the cache (and, with ``whole_items``, not ending inside an item). The items the chunk
        reaches are scheduled for encoding or pinned in the cache."""
        if self.whole_items:
            num_new = whole_items_chunk(items, start, num_new)
        end = start + num_new
        # in prompt order, so that a cut never leaves out an item scheduled before it
        for index, item in sorted(enumerate(items), key=lambda pair: pair[1].offset):
            if item.overlap(start, end) is None:
                continue
            key = item.content_hash
            if key in self._entries or key in self._step.keys:
                self._pin(key, req_id)
                continue
            if not self._fits(item):
                self.num_deferrals += 1
                return max(0, item.offset - start)
            self._schedule(req_id, index, item)
        return num_new

    def withdraw(self, req_id: str) -> None:
        """Take back what this step scheduled for ``req_id`` (it got no KV blocks, or was
        preempted) and its pins. Its rows stay spent from the step's budget (the step is only
        the lighter for it); an item no other request pins leaves the mirror unencoded."""
        scheduled = self._step.items.pop(req_id, [])
        self.release(req_id)
        for _, key in scheduled:
            if key not in self._pins:
                self._entries.pop(key, None)
                self._step.keys.discard(key)

    def release(self, req_id: str, done: list[MultiModalItem] | None = None) -> None:
        """Unpin ``done`` (the items ``req_id`` has computed past), or all its items."""
        for key in [k for k, reqs in self._pins.items() if req_id in reqs]:
            if done is not None and not any(item.content_hash == key for item in done):
                continue
            reqs = self._pins[key]
            reqs.discard(req_id)
            if not reqs:
                del self._pins[key]
                self._pinned_rows -= self._entries.get(key, 0)

    # -- inside ---------------------------------------------------------
    def _fits(self, item: MultiModalItem) -> bool:
        step = self._step
        if item.length > step.remaining and not (step.tokens == 0 and item.length > self.compute_budget):
            return False  # over what is left, and not an oversized item alone in an empty step
        if item.length > self.capacity:
            return True  # never kept: it needs no room
        return self.capacity - self._pinned_rows >= item.length

    def _schedule(self, req_id: str, index: int, item: MultiModalItem) -> None:
        step = self._step
        step.remaining -= item.length
        step.tokens += item.length
        step.items.setdefault(req_id, []).append((index, item.content_hash))
        step.keys.add(item.content_hash)
        if item.length <= self.capacity:
            self._allocate(item.content_hash, item.length)
            self._pin(item.content_hash, req_id)

    def _allocate(self, key: str, rows: int) -> None:
        used = sum(self._entries.values())
        for victim in [k for k in self._entries if k not in self._pins]:
            if used + rows <= self.capacity:
                break
            used -= self._entries.pop(victim)
            self._freed.append(victim)
        self._entries[key] = rows

    def _pin(self, key: str, req_id: str) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            reqs = self._pins.setdefault(key, set())
            if not reqs:
                self._pinned_rows += self._entries[key]
            reqs.add(req_id)
