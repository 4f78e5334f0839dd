"""Plugin kernels in step graphs: a call of a registered torch op recorded through its ``out`` overload.

A quantization plugin's kernel is not one of the platform's, so the graph has no method
of its own for it. The convention that lets the graph record it anyway: the plugin
registers the kernel (``TORCH_LIBRARY``, any namespace) as a functional op and an out
overload of the same arguments,

    ns::name(Tensor x, ...) -> Tensor
    ns::name.out(Tensor x, ..., *, Tensor(a!) out) -> Tensor(a!)

and its Python calls the functional op as ``torch.ops.ns.name(...)``, which the capture's
torch function mode sees. The capture then runs the functional op once (its results give
the out buffers' shapes and dtypes), takes a buffer per result from the graph's pool and
records a call of ``name.out`` into them (``StepGraph.call_out``: the arguments bound to
the schema once, each replay a boxed dispatcher call from C++). The out overload must
compute what the functional op computes, into the ``out`` it is given, without resizing
it: the capture checks both on the capture's own step, and refuses the op otherwise.
Several results take several out arguments (all keyword-only and written, in the order of
the results). An op without an out overload, or one that writes its inputs, is not
lowered: the capture refuses it, naming it, and those steps run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket

from tokenmill.plugin_api import StepGraphUnsupported

OUT = "out"  # the overload name the convention asks for


def is_registered_op(func: Any) -> bool:
    """Whether ``func`` is a ``torch.ops.<ns>.<name>`` op (or one of its overloads)."""
    return isinstance(func, OpOverloadPacket | OpOverload)


def op_name(func: OpOverloadPacket | OpOverload) -> str:
    """``ns::name`` (with ``.overload`` for an overload other than the default)."""
    if isinstance(func, OpOverload):
        name = func._schema.name
        return name if func._overloadname == "default" else f"{name}.{func._overloadname}"
    return func._qualified_op_name


def out_overload(func: OpOverloadPacket | OpOverload) -> OpOverload | None:
    """The out overload a call of ``func`` can be recorded as, or None: ``func`` is the op's
    packet or its default overload, the default overload writes none of its arguments, and
    the packet has ``.out`` with keyword-only written out arguments."""
    packet = func if isinstance(func, OpOverloadPacket) else func.overloadpacket
    if isinstance(func, OpOverload) and func._overloadname != "default":
        return None
    names = packet.overloads()
    if "default" not in names or OUT not in names:
        return None
    if any(_writes(argument) for argument in packet.default._schema.arguments):
        return None
    out = getattr(packet, OUT)
    return out if _out_arguments(out) else None


def record_out_call(graph: Any, func: OpOverloadPacket | OpOverload, out: OpOverload, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """Run ``func(*args, **kwargs)`` and record it into ``graph`` as a call of ``out`` into
    pooled buffers; returns those buffers as ``func`` returns its results."""
    name = op_name(func)
    result = func(*args, **kwargs)
    results = list(result) if isinstance(result, tuple | list) else [result]
    out_names = _out_arguments(out)
    if len(results) != len(out_names) or not all(isinstance(t, torch.Tensor) for t in results):
        raise StepGraphUnsupported(f"torch op {name} returns {len(results)} values, its .out overload writes "
                                   f"{len(out_names)} tensors")
    buffers = [graph.buffer_like(t) for t in results]
    addresses = [b.data_ptr() for b in buffers]
    try:
        graph.call_out(out._schema.name, OUT, tuple(args), {**kwargs, **dict(zip(out_names, buffers, strict=True))})
    except RuntimeError as exc:
        raise StepGraphUnsupported(f"torch op {name}.out failed in the capture: {exc}") from exc
    for buffer, address, expected in zip(buffers, addresses, results, strict=True):
        if buffer.data_ptr() != address or buffer.shape != expected.shape:
            raise StepGraphUnsupported(f"torch op {name}.out resized its out tensor (a step graph's buffer)")
        if not torch.equal(buffer, expected):
            raise StepGraphUnsupported(f"torch op {name}.out wrote other values than {name} computed")
    return buffers[0] if not isinstance(result, tuple | list) else tuple(buffers)


def _out_arguments(out: OpOverload) -> list[str]:
    """The names of ``out``'s out arguments: keyword-only, written."""
    return [argument.name for argument in out._schema.arguments if argument.kwarg_only and _writes(argument)]


def _writes(argument: Any) -> bool:
    return argument.alias_info is not None and bool(argument.alias_info.is_write)
