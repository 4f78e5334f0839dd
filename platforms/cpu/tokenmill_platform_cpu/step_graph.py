"""Capturing a forward as a step graph (``kernels/step_graph.cpp``) to replay it from C++.

While a capture runs, :func:`active_kernels` hands the layer ops and the attention
backend the graph in place of the kernels module, so every kernel call both runs
and is recorded. Whatever else the forward does goes through torch, and a torch
call would not be replayed, so a torch function mode watches them all: allocations,
views (outputs that alias an input) and metadata (shapes, strides) are safe, the
token embedding, torch's linear (matmuls the kernels do not take), torch.cat and
contiguous copies are lowered to graph ops, and so is a call of any registered op
(``torch.ops.<ns>.<name>``: a plugin's C++ kernel) that has an out overload
``name.out(..., *, Tensor(a!) out) -> Tensor(a!)``, recorded as a boxed call of that
overload into a pooled buffer (:mod:`.out_overloads` states the contract). Anything else
(another computation, an op without an out overload, an in-place op, a value read back
into Python) makes the capture fail with the call's name; the model runner then runs
that batch size eagerly. A failed capture has only run the step's own kernels (its K/V
writes included), so running the step again eagerly is harmless; the one kernel that
adds to a tensor rather than writing it (the MoE layers' expert-load counts,
``routed_moe``) has the counts put back, so that the eager rerun does not count the
step twice.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from tokenmill.plugin_api import StepGraphUnsupported
from tokenmill_platform_cpu.out_overloads import is_registered_op, op_name, out_overload, record_out_call

_ALLOCATIONS = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}
# Calls that return facts about a tensor rather than its values (`__get__`: shape, dtype, ...).
_METADATA = {"__get__", "dim", "size", "stride", "numel", "__len__", "is_contiguous", "element_size",
             "storage_offset", "is_floating_point", "get_device"}
_IN_PLACE_OPERATORS = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
                       "lshift", "rshift"}
_recording: ContextVar[_Recorder | None] = ContextVar("tokenmill_cpu_step_graph", default=None)


def active_kernels(kernels: ModuleType) -> Any:
    """What a layer op or the attention backend should call a kernel on now: the
    kernels module, or, while a forward is being captured, the graph recording it."""
    recorder = _recording.get()
    return kernels if recorder is None else recorder


def capture_step_graph(kernels: ModuleType, run: Callable[[], tuple[torch.Tensor, ...]], pool: Any,
                       rows: int) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """Run ``run`` (a forward of ``rows`` tokens) once, recording its kernel calls into
    buffers from ``pool`` (a ``kernels.GraphPool``); returns the graph and the tensors
    ``run`` returned, which each replay rewrites. The graph is the C++ ``StepGraph``
    (``replay()``, ``len()``). Raises StepGraphUnsupported."""
    recorder = _Recorder(kernels.StepGraph(pool, rows))
    token = _recording.set(recorder)
    try:
        with _TorchCallGuard(recorder):
            out = run()
    except BaseException:
        recorder.restore_counts()
        raise
    finally:
        _recording.reset(token)
    if not isinstance(out, tuple) or not all(isinstance(t, torch.Tensor) for t in out):
        raise StepGraphUnsupported(f"the forward returned {type(out).__name__}, not a tuple of tensors")
    return recorder.graph, out


class _Recorder:
    """The graph behind the kernels module's names."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self._counts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a counter, its values before the capture)

    def routed_moe(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   top_k: int, renormalize: bool, expert_load: torch.Tensor,
                   packed: torch.Tensor | None = None) -> torch.Tensor:
        with torch._C.DisableTorchFunction():  # a copy of our own, not a call of the forward's
            self._counts.append((expert_load, expert_load.clone()))
        return self.graph.routed_moe(x, router_logits, w13, w2, top_k, renormalize, expert_load, packed=packed)

    def restore_counts(self) -> None:
        """Undo the capture run's additions to counters: a failed capture's step reruns eagerly."""
        for counter, before in reversed(self._counts):
            counter.copy_(before)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            return getattr(self.graph, name)
        except AttributeError:
            raise StepGraphUnsupported(f"kernel {name!r} has no step-graph form") from None


class _TorchCallGuard(TorchFunctionMode):
    """Sees every torch call the forward makes in Python (not the ones inside the kernels,
    which are C++): a torch function mode rather than a dispatch mode, because the first
    dispatch mode of a process imports ~900 modules (~1 s, ~140 MB)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if func is F.embedding and _plain_embedding(args, kwargs):
            return self._recorder.embedding(args[1], args[0])
        if func is F.linear:
            return self._recorder.linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
        if name == "contiguous" and args[0].is_contiguous():
            return args[0]
        if name in ("contiguous", "clone"):  # clone: always a copy
            return self._recorder.contiguous(args[0])
        if func is torch.cat and _plain_cat(args, kwargs):
            return self._recorder.cat(list(args[0]), args[1] if len(args) > 1 else kwargs.get("dim", 0))
        if _writes(name, kwargs):
            raise StepGraphUnsupported(f"torch call {name} writes a tensor outside the kernels")
        if is_registered_op(func) and (out_op := out_overload(func)) is not None:
            return record_out_call(self._recorder.graph, func, out_op, args, kwargs)
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            return out
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tensors and _alias_inputs(tensors, args, kwargs):
            return out  # a view
        if not tensors and name in _METADATA:
            return out
        if tensors and is_registered_op(func):
            raise StepGraphUnsupported(f"torch op {op_name(func)} computes outside the kernels and has no out "
                                       f"overload to record ({op_name(func)}.out(..., *, Tensor(a!) out))")
        raise StepGraphUnsupported(f"torch call {name} {'computes' if tensors else 'reads a value'} outside the kernels")


def _plain_embedding(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A row lookup: 1-d ids and no max_norm (which renormalises the table in place)."""
    max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
    return isinstance(args[0], torch.Tensor) and args[0].dim() == 1 and max_norm is None


def _plain_cat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Tensors of one dtype joined along an int dim, into a new tensor (no ``out``)."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return (isinstance(tensors, (list, tuple)) and len(tensors) > 0 and isinstance(dim, int)
            and all(isinstance(t, torch.Tensor) and t.dtype == tensors[0].dtype for t in tensors)
            and kwargs.get("out") is None)


def _writes(name: str, kwargs: dict[str, Any]) -> bool:
    in_place = name.endswith("_") and not name.endswith("__")
    operator_in_place = name.startswith("__i") and name[3:-2] in _IN_PLACE_OPERATORS
    return in_place or operator_in_place or name == "__setitem__" or kwargs.get("out") is not None


def _alias_inputs(outputs: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in inputs for t in outputs)
