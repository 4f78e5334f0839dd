"""The connector's options (``kv_connector_extra_config``) and what each step's metadata holds."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

BlockRef = tuple[int, str]  # (block id in the paged cache, the block's prefix-cache hash in hex)


_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


class ZmqOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bind: str | None = Field(None, description="producer: the ZeroMQ endpoint it serves on (tcp://HOST:PORT)")
    advertise_host: str | None = Field(None, description="producer: the host its kv_transfer_params name (default: "
                                                         "bind's host, or this machine's name for a wildcard bind)")
    peers: list[str] = Field(default_factory=list, description="consumer: the producers it asks for a request "
                                                               "whose kv_transfer_params name none")
    lease_s: float = Field(30.0, gt=0, description="producer: how long unfetched blocks are kept")
    fetch_timeout_s: float = Field(5.0, gt=0, description="consumer: how long a fetch may take before recompute")

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ZmqOptions:
        return cls.model_validate(extra)

    def advertised_address(self) -> tuple[str, int]:
        """(host, port) where consumers reach this producer: what its kv_transfer_params say."""
        assert self.bind is not None
        host, sep, port = self.bind.removeprefix("tcp://").rpartition(":")
        if not self.bind.startswith("tcp://") or not sep or not port.isdigit():
            raise ValueError(f"kv_zmq: bind must be tcp://HOST:PORT, got {self.bind!r}")
        if self.advertise_host:
            host = self.advertise_host
        elif host in _WILDCARDS:
            host = socket.gethostname()
        return host.removeprefix("[").removesuffix("]"), int(port)


def rank_endpoint(base: str, rank: int) -> str:
    """Rank ``rank``'s endpoint under tensor parallelism: each rank serves (and fetches) its own KV
    heads on the base port plus its rank; rank 0's is the base itself."""
    if rank == 0:
        return base
    head, sep, port = base.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"kv_zmq: an endpoint under tensor parallelism must be tcp://HOST:PORT, got {base!r}")
    return f"{head}:{int(port) + rank}"


def endpoint(host: str, port: int) -> str:
    """The ZeroMQ endpoint of a producer that kv_transfer_params name (an IPv6 address bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(frozen=True)
class FetchSource:
    """Where a consumer asks for one request's blocks: ``peers`` (the producer its
    kv_transfer_params name, else the configured ones); ``remote_request_id``: the producer's
    request that holds them, when known (served first, and freed once sent)."""

    peers: tuple[str, ...]
    remote_request_id: str | None = None


@dataclass
class ZmqMetadata:
    """One step's instructions to the worker half.

    ``loads``: per request, the blocks to fetch into, and ``sources`` where to fetch them from.
    ``computed`` (producer): per request, the
    prompt blocks whose KV this step completes: servable once the step's forward wrote them.
    ``kept`` (producer): requests that finished with their blocks kept for a consumer: their
    lease starts. ``cancelled``: requests that ended otherwise since the last step: their
    fetches are dropped and their blocks offered no more, before this step writes into them.
    """

    loads: dict[str, list[BlockRef]] = field(default_factory=dict)
    computed: dict[str, list[BlockRef]] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    sources: dict[str, FetchSource] = field(default_factory=dict)
