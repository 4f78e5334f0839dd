"""The core's own hook implementations, registered ``trylast`` like any plugin."""

from __future__ import annotations

from typing import Any

from tokenmill.hookspecs import hookimpl
from tokenmill.plugins.specs import AttentionBackendSpec


@hookimpl(trylast=True)
def tokenmill_select_attention_backend(request: Any, candidates: list[AttentionBackendSpec]) -> str | None:
    """An explicit choice wins; otherwise the first candidate: the core passes them best ranked
    first (by priority on this platform, tokenmill.attention.selection)."""
    if request.preferred is not None:
        return request.preferred
    return candidates[0].name if candidates else None


@hookimpl
def tokenmill_register_structured_output_backends() -> dict[str, str]:
    """xgrammar is the built-in backend (imported only when a request is constrained)."""
    return {"xgrammar": "tokenmill.structured_output.xgrammar_backend:XgrammarBackend"}


@hookimpl
def tokenmill_register_executors() -> dict[str, str]:
    """The in-process executor (one worker in the engine's own process), the multi-process
    one (a worker process per rank) and the Ray one (a Ray actor per rank; Ray is optional,
    imported only when it is chosen)."""
    return {"uni": "tokenmill.executor.uniproc:UniProcExecutor", "mp": "tokenmill.executor.multiproc:MultiprocExecutor",
            "ray": "tokenmill.executor.ray_executor:RayExecutor"}
