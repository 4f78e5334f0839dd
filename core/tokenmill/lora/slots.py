"""Which adapter each device slot holds, and how many requests hold it there (engine side)."""

from __future__ import annotations

import itertools

from tokenmill.lora.adapter import LoRAAdapter


class LoRASlotTable:
    """``num_slots`` device slots. A request reserves its adapter's slot from the time it joins
    the waiting queue until it finishes (preempted requests keep theirs), so a slot is only
    reassigned when no request uses it: eviction never takes an adapter from under a running
    request. A free slot is taken first, then the least recently used idle one."""

    def __init__(self, num_slots: int) -> None:
        self.names: list[str | None] = [None] * num_slots
        self.users = [0] * num_slots
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self._loads: dict[int, LoRAAdapter] = {}  # assigned since the last step: the workers copy these in

    def slot_of(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def acquire(self, adapter: LoRAAdapter) -> int | None:
        """Reserve a slot holding ``adapter`` (loading it into one if needed); None when every
        slot holds an adapter that requests still use."""
        slot = self.slot_of(adapter.name)
        if slot is None:
            idle = [s for s in range(len(self.names)) if self.users[s] == 0]
            if not idle:
                return None
            slot = min(idle, key=lambda s: (self.names[s] is not None, self._last_used[s]))
            self.names[slot] = adapter.name
            self._loads[slot] = adapter
        self.users[slot] += 1
        self._last_used[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1

    def retire(self, name: str) -> None:
        """An unloaded adapter: its slot serves the requests that hold it, but no new one."""
        slot = self.slot_of(name)
        if slot is not None:
            self.names[slot] = f"\0retired {name} {next(self._clock)}"  # no adapter name matches it

    def take_loads(self) -> dict[int, LoRAAdapter]:
        loads, self._loads = self._loads, {}
        return loads

    @property
    def num_resident(self) -> int:
        return sum(1 for name in self.names if name is not None and not name.startswith("\0"))
