"""Capturing a forward as a step graph (``kernels/step_graph.cpp``) to replay it from C++.

While a capture runs, :func:`active_kernels` hands the layer ops and the attention
backend the graph in place of the kernels module, so every kernel call both runs
and is recorded. Whatever else the forward does goes through torch, and a torch
op would not be replayed, so a dispatch mode watches them all: allocations and
views (outputs that alias an input) are safe, the token embedding and contiguous
copies are lowered to graph ops, and anything else (a matmul torch runs, an in-place op, reading a value
back into Python) makes the capture fail with the op's name; the model runner then
runs that batch size eagerly. A failed capture has only run the step's own kernels
(its K/V writes included), so running the step again eagerly is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tokenmill.worker.step_graphs import StepGraphUnsupported

_aten = torch.ops.aten
_ALLOCATIONS = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty}
_recording: ContextVar[_Recorder | None] = ContextVar("tokenmill_cpu_step_graph", default=None)


def active_kernels(kernels: ModuleType) -> Any:
    """What a layer op or the attention backend should call a kernel on now: the
    kernels module, or, while a forward is being captured, the graph recording it."""
    recorder = _recording.get()
    return kernels if recorder is None else recorder


class CpuStepGraph:
    def __init__(self, graph: Any) -> None:
        self._graph = graph

    def replay(self) -> None:
        self._graph.replay()

    def __len__(self) -> int:
        return len(self._graph)


def capture_step_graph(kernels: ModuleType, run: Callable[[], torch.Tensor]) -> tuple[CpuStepGraph, torch.Tensor]:
    """Run ``run`` once, recording its kernel calls; returns the graph and the tensor
    ``run`` returned, which each replay rewrites. Raises StepGraphUnsupported."""
    recorder = _Recorder(kernels.StepGraph())
    token = _recording.set(recorder)
    try:
        with _TorchOpGuard(recorder):
            out = run()
    finally:
        _recording.reset(token)
    if not isinstance(out, torch.Tensor):
        raise StepGraphUnsupported(f"the forward returned {type(out).__name__}, not a tensor")
    return CpuStepGraph(recorder.graph), out


class _Recorder:
    """The graph behind the kernels module's names; counts the calls in progress so
    the guard lets through the torch ops a kernel makes itself (allocations, say)."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.inside = 0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            method = getattr(self.graph, name)
        except AttributeError:
            raise StepGraphUnsupported(f"kernel {name!r} has no step-graph form") from None

        def call(*args: Any, **kwargs: Any) -> Any:
            self.inside += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.inside -= 1

        return call


class _TorchOpGuard(TorchDispatchMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._recorder.inside:
            return func(*args, **kwargs)
        if func is _aten.embedding.default and args[1].dim() == 1:
            return self._recorder.embedding(args[0], args[1])
        if func is _aten.contiguous.default and args[0].is_contiguous():
            return args[0]
        if func in (_aten.contiguous.default, _aten.clone.default):  # clone: always a copy
            return self._recorder.contiguous(args[0])
        if func._schema.is_mutable:
            raise StepGraphUnsupported(f"torch op {func} writes a tensor outside the kernels")
        out = func(*args, **kwargs)
        if func.overloadpacket in _ALLOCATIONS or _is_view(out, args):
            return out
        raise StepGraphUnsupported(f"torch op {func} computes outside the kernels")


def _is_view(out: Any, args: tuple[Any, ...]) -> bool:
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
    return bool(outputs) and all(t.untyped_storage().data_ptr() in inputs for t in outputs)
