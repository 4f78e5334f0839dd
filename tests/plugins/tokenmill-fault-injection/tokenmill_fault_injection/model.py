"""A model that fails on purpose, wrapped around a real one.

- a prompt holding ``raise_token``: the forward raises (an engine failure);
- a prompt holding ``sleep_token``: the forward sleeps ``sleep_s`` (a stalled loop);
- a position whose input is ``nan_token``: its final hidden state is NaN, so a
  prompt ending in it gets NaN logits (a per-request numerical failure). The KV
  cache stays clean: the NaN is written after the inner model ran.

The poison ids are masked out of the logits, so they are never sampled: only
a prompt can carry them, and a healthy request never trips a fault.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.layers import ModelBuildContext
from tokenmill.plugin_api import get_plugin_manager, resolve_qualname


class InjectedFault(RuntimeError):
    """Raised by the forward when a prompt holds the raise token."""


@dataclass(frozen=True)
class FaultConfig:
    inner_architecture: str = "LlamaForCausalLM"
    raise_token: int | None = None
    nan_token: int | None = None
    sleep_token: int | None = None
    sleep_s: float = 3.0

    @classmethod
    def of(cls, hf_config: Any) -> FaultConfig:
        return cls(**(getattr(hf_config, "fault_injection", None) or {}))

    @property
    def poison_ids(self) -> list[int]:
        return [t for t in (self.raise_token, self.nan_token, self.sleep_token) if t is not None]


def _inner_class(architecture: str) -> type:
    """The wrapped architecture, found through the plugin registry like any other."""
    registered = get_plugin_manager().collect_named("tokenmill_register_models")
    return resolve_qualname(registered[architecture][1].qualname)


class FaultInjectionForCausalLM(nn.Module):
    def __init__(self, config: Any, *, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.faults = FaultConfig.of(config)
        # The same context: the inner model's layers have the checkpoint's names.
        self.inner = _inner_class(self.faults.inner_architecture)(config, ctx=ctx)

    def _holds(self, input_ids: torch.Tensor, token: int | None) -> bool:
        return token is not None and bool((input_ids == token).any())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        if self._holds(input_ids, self.faults.raise_token):
            raise InjectedFault(f"fault injection: the forward met poison token {self.faults.raise_token}")
        if self._holds(input_ids, self.faults.sleep_token):
            time.sleep(self.faults.sleep_s)
        hidden = self.inner(input_ids, positions, metadata)
        if self._holds(input_ids, self.faults.nan_token):
            hidden = hidden.clone()
            hidden[input_ids == self.faults.nan_token] = float("nan")
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.inner.compute_logits(hidden)
        if self.faults.poison_ids:
            logits[:, self.faults.poison_ids] = float("-inf")
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return {f"inner.{name}" for name in self.inner.load_weights(weights)}
