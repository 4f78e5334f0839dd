"""What every checkpoint format resolves to before a model is built."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WeightsIterator = Iterator[tuple[str, torch.Tensor]]


@dataclass
class Checkpoint:
    """A model checkpoint, format-independent.

    ``hf_config`` is a ``transformers.PretrainedConfig``; ``weights`` yields
    ``(name, tensor)`` pairs under Hugging Face parameter names, lazily, so a
    loader never holds two copies of the model; ``tokenizer`` is a
    ``transformers`` tokenizer (or ``None`` when the checkpoint has none).
    """

    path: Path
    hf_config: Any
    weights: Callable[[], WeightsIterator]
    tokenizer: Any
    generation_config: dict[str, Any] = field(default_factory=dict)
    format: str = "safetensors"

    @property
    def text_config(self) -> Any:
        """The language model's config: the whole config for a text model, its
        ``text_config`` for a multimodal one (vocabulary, context length, heads)."""
        get = getattr(self.hf_config, "get_text_config", None)
        return get() if callable(get) else self.hf_config

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])
