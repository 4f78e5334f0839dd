"""Loading a vision-language checkpoint: one file set holds the vision tower (and projector) and
the language model, whose tensors the language model's own plugin loads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.layers import load_weight

LANGUAGE_PREFIX = "language_model."


def load_composite_weights(model: nn.Module, language_model: Any, weights: Iterable[tuple[str, torch.Tensor]],
                           canonical: Callable[[str], str], skipped: tuple[str, ...] = ()) -> set[str]:
    """Load ``weights`` into ``model``: names (after ``canonical``, which maps the checkpoint's
    layout onto the model's) under ``language_model.`` stream to ``language_model.load_weights``,
    names under ``skipped`` are dropped (a tower's unused layers), every other one must be a
    parameter of ``model``. Returns the loaded names in ``model``'s namespace."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()

    def language_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = canonical(name)
            if name.startswith(LANGUAGE_PREFIX):
                yield name.removeprefix(LANGUAGE_PREFIX), tensor
            elif not (skipped and name.startswith(skipped)):
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
                load_weight(params[name], tensor)
                loaded.add(name)

    # The language model pulls from the generator, so the tower's tensors load as they pass by.
    return loaded | {LANGUAGE_PREFIX + name for name in language_model.load_weights(language_weights())}
