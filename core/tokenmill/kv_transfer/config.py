"""``kv_transfer_config``: which KV connector an engine uses and in which role (vLLM's names)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class KVTransferConfig(BaseModel):
    """``{"kv_connector": NAME, "kv_role": ..., "kv_connector_extra_config": {...}}``.

    ``kv_role``: a ``kv_producer`` computes prompts and offers their KV, a ``kv_consumer`` loads
    KV others computed, ``kv_both`` does both (an offload tier: what it computes it may load back).
    ``kv_connector_extra_config`` is the connector's own options, handed to it untouched.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_connector: str = Field(description="Connector name, as registered (see `tokenmill plugins`)")
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = Field(
        "kv_both", description="kv_producer, kv_consumer or kv_both")
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict,
                                                      description="The connector's own options")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
