"""The prefill and decode servers a router sends to, and choosing the least loaded one."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import httpx

# How long a server has to answer ``/engine/stats`` before it is left out of one choice.
STATS_TIMEOUT_S = 1.0


@dataclass(eq=False)
class Backend:
    """One ``tokenmill serve`` process; ``in_flight`` counts the router's requests on it now."""

    url: str
    in_flight: int = 0

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")


class BackendPool:
    """Servers of one role (prefill or decode). The least loaded is the one with the fewest
    requests in its engine (``/engine/stats``: unfinished and queued) plus the router's own not
    yet counted there; a server that does not answer is left out, and ties go round-robin."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"the router needs at least one {role} server")
        self.role = role
        self.backends = [Backend(url) for url in urls]
        self._turn = itertools.count()

    async def choose(self, client: httpx.AsyncClient, headers: dict[str, str]) -> Backend | None:
        """The least loaded reachable server, or None if none answers."""
        loads = await asyncio.gather(*(self._load(client, b, headers) for b in self.backends))
        start = next(self._turn) % len(self.backends)
        order = self.backends[start:] + self.backends[:start]
        reachable = [(loads[self.backends.index(b)], b) for b in order if loads[self.backends.index(b)] is not None]
        if not reachable:
            return None
        return min(reachable, key=lambda pair: pair[0] or 0)[1]

    @staticmethod
    async def _load(client: httpx.AsyncClient, backend: Backend, headers: dict[str, str]) -> int | None:
        try:
            response = await client.get(f"{backend.url}/engine/stats", headers=headers, timeout=STATS_TIMEOUT_S)
            stats = response.raise_for_status().json()
        except (httpx.HTTPError, ValueError):
            return None
        return int(stats.get("unfinished", 0)) + int(stats.get("queued", 0)) + backend.in_flight
