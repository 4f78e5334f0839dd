"""What the model runner needs from a model plugin's class (docs/plugins.md)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step's flattened tokens."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]``, called only on the positions that sample."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def modules(self) -> Iterator[nn.Module]: ...
