"""What every checkpoint format resolves to before a model is built."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WeightsIterator = Iterator[tuple[str, torch.Tensor]]
NameFilter = Callable[[str], bool]


@dataclass
class Checkpoint:
    """A model checkpoint, format-independent.

    ``hf_config`` is a ``transformers.PretrainedConfig``; ``weights`` yields
    ``(name, tensor)`` pairs under Hugging Face parameter names, lazily, so a
    loader never holds two copies of the model; ``tokenizer`` is a
    ``transformers`` tokenizer (or ``None`` when the checkpoint has none).
    ``select_weights``, where the format can skip a tensor without reading it (safetensors),
    yields only the pairs whose names pass a filter (:meth:`weights_where`).
    """

    path: Path
    hf_config: Any
    weights: Callable[[], WeightsIterator]
    tokenizer: Any
    generation_config: dict[str, Any] = field(default_factory=dict)
    format: str = "safetensors"
    select_weights: Callable[[NameFilter], WeightsIterator] | None = None

    def weights_where(self, keep: NameFilter) -> WeightsIterator:
        """The ``(name, tensor)`` pairs whose name ``keep`` accepts; the others are not read where
        the format allows (an expert-parallel rank skips the other ranks' experts)."""
        if self.select_weights is not None:
            return self.select_weights(keep)
        return ((name, tensor) for name, tensor in self.weights() if keep(name))

    @property
    def text_config(self) -> Any:
        """The language model's config: the whole config for a text model, its
        ``text_config`` for a multimodal one (vocabulary, context length, heads)."""
        get = getattr(self.hf_config, "get_text_config", None)
        return get() if callable(get) else self.hf_config

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])
