"""tokenmill: a plugin-first LLM inference and serving engine.

The public API mirrors vLLM's: ``from tokenmill import LLM, SamplingParams``.
Heavy modules load on first use, so ``import tokenmill`` stays cheap for
plugins and the CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.errors import (
    EngineDeadError,
    InvalidRequestError,
    InvalidStateTransition,
    ModelNotFoundError,
    PluginError,
    QueueFullError,
    TokenmillError,
    UnsupportedModelError,
)
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.entrypoints.async_llm import AsyncLLM
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.lora.request import LoRARequest
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"

_LAZY = {
    "LLM": "tokenmill.entrypoints.llm",
    "AsyncLLM": "tokenmill.entrypoints.async_llm",
    "EngineConfig": "tokenmill.config",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "LoRARequest": "tokenmill.lora.request",
    "StructuredOutputsParams": "tokenmill.structured_output.params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


__all__ = [
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "InvalidStateTransition",
    "LLM",
    "LoRARequest",
    "ModelNotFoundError",
    "PluginError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TokenmillError",
    "UnsupportedModelError",
]
