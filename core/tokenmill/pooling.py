"""How an embedding model pools its hidden states, read from the sentence-transformers files.

A sentence-transformers folder says what to do after the transformer in
``modules.json``: a ``Pooling`` module (whose ``config.json`` picks the CLS token,
the mean over the tokens or the last token) and, optionally, ``Normalize``
(unit length). ``config_sentence_transformers.json`` or the model's config may
name Matryoshka dimensions: truncating such an embedding to fewer dimensions
keeps it meaningful, which is what the ``dimensions`` of an embedding request needs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import InvalidRequestError

# pooling_mode_* key of 1_Pooling/config.json -> the engine's pooling type
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling``: "cls", "mean" or "last"; ``normalize``: scale each embedding to unit length;
    ``matryoshka_dimensions``: the sizes it may be truncated to (empty: only its own), or None
    when any size up to its own is fine."""

    pooling: str
    normalize: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = ()


def read_pooler_config(folder: Path, hf_config: Any, default_pooling: str) -> PoolerConfig:
    """The folder's sentence-transformers pooling, else ``default_pooling`` unnormalised."""
    pooling, normalize = default_pooling, False
    modules = _read_json(folder / "modules.json")
    if isinstance(modules, list):
        for module in modules:
            kind = str(module.get("type", ""))
            if kind.endswith(".Pooling"):
                pooling = _pooling_mode(_read_json(folder / str(module.get("path", "")) / "config.json"), pooling)
            elif kind.endswith(".Normalize"):
                normalize = True
    return PoolerConfig(pooling, normalize, _matryoshka(hf_config))


def _pooling_mode(config: Any, fallback: str) -> str:
    if not isinstance(config, dict):
        return fallback
    chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    return chosen[0] if len(chosen) == 1 else fallback  # max / sqrt-len / mixtures are not offered


def _matryoshka(hf_config: Any) -> tuple[int, ...] | None:
    if getattr(hf_config, "is_matryoshka", False) and not getattr(hf_config, "matryoshka_dimensions", None):
        return None
    return tuple(int(d) for d in getattr(hf_config, "matryoshka_dimensions", None) or ())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def finish_embedding(vector: list[float], config: PoolerConfig | None, dimensions: int | None = None) -> list[float]:
    """The pooled vector as the model's users expect it: truncated to ``dimensions`` (Matryoshka
    models only), then normalised where the model normalises."""
    if dimensions is not None:
        check_dimensions(config, len(vector), dimensions)
        vector = vector[:dimensions]
    if config is not None and config.normalize:  # numpy: a Python loop over the floats cost 2% of MiniLM's run
        array = np.asarray(vector, dtype=np.float64)
        norm = math.sqrt(float(array @ array))
        if norm > 0:
            vector = (array / norm).tolist()
    return vector


def check_matryoshka(config: PoolerConfig | None) -> None:
    """``dimensions`` is only for models trained to be truncated."""
    if config is None or config.matryoshka_dimensions == ():
        raise InvalidRequestError("dimensions is only supported by Matryoshka models; this model's embeddings "
                                  "have their own fixed width", param="dimensions")


def check_dimensions(config: PoolerConfig | None, size: int, dimensions: int) -> None:
    check_matryoshka(config)
    allowed = config.matryoshka_dimensions if config is not None else ()
    if not 1 <= dimensions <= size or (allowed is not None and dimensions not in allowed):
        raise InvalidRequestError(f"dimensions must be one of {list(allowed) if allowed else f'1..{size}'}, "
                                  f"got {dimensions}", param="dimensions")
