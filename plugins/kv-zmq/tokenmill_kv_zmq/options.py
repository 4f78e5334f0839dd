"""The connector's options (``kv_connector_extra_config``) and what each step's metadata holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

BlockRef = tuple[int, str]  # (block id in the paged cache, the block's prefix-cache hash in hex)


class ZmqOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bind: str | None = Field(None, description="producer: the ZeroMQ endpoint it serves on (tcp://HOST:PORT)")
    peers: list[str] = Field(default_factory=list, description="consumer: the producers' endpoints it asks")
    lease_s: float = Field(30.0, gt=0, description="producer: how long unfetched blocks are kept")
    fetch_timeout_s: float = Field(5.0, gt=0, description="consumer: how long a fetch may take before recompute")

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ZmqOptions:
        return cls.model_validate(extra)


@dataclass
class ZmqMetadata:
    """One step's instructions to the worker half.

    ``loads``: per request, the blocks to fetch into. ``computed`` (producer): per request, the
    prompt blocks whose KV this step completes: servable once the step's forward wrote them.
    ``kept`` (producer): requests that finished with their blocks kept for a consumer: their
    lease starts. ``cancelled``: requests that ended otherwise since the last step: their
    fetches are dropped and their blocks offered no more, before this step writes into them.
    """

    loads: dict[str, list[BlockRef]] = field(default_factory=dict)
    computed: dict[str, list[BlockRef]] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
