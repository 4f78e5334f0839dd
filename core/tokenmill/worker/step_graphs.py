"""Step graphs: a decode forward captured once per batch size and replayed.

At small decode batches a forward's kernels do little work each, and launching
them from Python costs as much as they run (on the CPU ~1 ms of a 7 ms batch-1
step). A platform that can record a forward's kernel calls (the
``tokenmill.platform.StepGraphCapture`` capability: the CPU platform's C++ step
graph; CUDA graphs would fit the same seam) lets the
runner replay them instead: the inputs are copied into the captured tensors, the
graph reruns every kernel on the same buffers, and the captured outputs hold the
hidden states and the logits of every token (each request of a decode step samples
its one token, so the lm_head belongs in the graph too).

Which steps qualify: uniform decode (one new token per request) of at most
``max_batch_size`` requests, on an attention backend that declares
``supports_step_graphs`` — its promise that for such steps its work depends only
on the contents of the metadata's tensors and of its ``prepare`` result, never on
Python values that change from step to step. The first step of each batch size is
the capture (a real step, so it costs nothing extra); a batch size whose capture
fails runs eagerly from then on.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from tokenmill.attention import AttentionBackend, AttentionMetadata
from tokenmill.platform import StepGraph, StepGraphCapture, StepGraphUnsupported
from tokenmill.worker.model_interface import CausalLM
from tokenmill.worker.step_inputs import StepInputs

# The capture types live with the platform's other capabilities (tokenmill.platform); re-exported.
__all__ = ["DecodeGraphs", "KernelProfile", "StepGraph", "StepGraphCapture", "StepGraphUnsupported"]

logger = logging.getLogger(__name__)
# The metadata tensors a replay refreshes (the block table separately: it is captured at full width).
_METADATA_TENSORS = ("query_start_loc", "seq_lens", "context_lens", "slot_mapping")


@dataclasses.dataclass
class KernelProfile:
    """Seconds and calls per kernel over the profiled replays (``DecodeGraphs.kernel_profile``),
    from graphs that can time their kernels (an optional ``profile()`` returning (name,
    seconds) per call, in order, as the CPU platform's do)."""

    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    steps: int = 0

    def add(self, times: list[tuple[str, float]]) -> None:
        for name, seconds in times:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.calls[name] = self.calls.get(name, 0) + 1
        self.steps += 1


@dataclasses.dataclass
class _Captured:
    graph: StepGraph
    hidden: torch.Tensor
    logits: torch.Tensor | None  # of every token, where the lm_head could be captured too
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata  # its tensors are the ones the graph reads
    backend_tensors: list[torch.Tensor]
    backend_layout: Any  # the backend data with its tensors left out: a replay needs the same

    def load(self, inputs: StepInputs, backend_data: Any) -> bool:
        """Copy a step's inputs into the captured tensors; False if its backend data is laid out differently."""
        tensors: list[torch.Tensor] = []
        if _layout(backend_data, tensors) != self.backend_layout:
            return False
        self.input_ids.copy_(inputs.input_ids)
        self.positions.copy_(inputs.positions)
        for name in _METADATA_TENSORS:
            getattr(self.metadata, name).copy_(getattr(inputs.metadata, name))
        table = inputs.metadata.block_table
        self.metadata.block_table[:, : table.shape[1]].copy_(table)
        for captured, new in zip(self.backend_tensors, tensors, strict=True):
            captured.copy_(new)
        return True


class DecodeGraphs:
    """The step graphs of one model runner, by decode batch size."""

    def __init__(self, capture: StepGraphCapture, backend: AttentionBackend, max_batch_size: int,
                 max_blocks_per_seq: int) -> None:
        self._capture = capture
        self._backend = backend
        self._max_batch_size = max_batch_size
        self._max_blocks = max_blocks_per_seq
        self._pool = capture.new_graph_pool(max_batch_size)
        self._graphs: dict[int, _Captured] = {}
        self._eager: set[int] = set()  # batch sizes whose capture failed
        # Set to time each kernel of every replay (scripts/profile_step.py); off by default.
        self.kernel_profile: KernelProfile | None = None

    def clear(self) -> None:
        """Forget every graph (they hold the KV cache they were captured on)."""
        self._graphs.clear()
        self._eager.clear()
        self._pool = self._capture.new_graph_pool(self._max_batch_size)

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes captured."""
        return sorted(self._graphs)

    @property
    def lm_head_batch_sizes(self) -> list[int]:
        """The batch sizes whose graph runs the lm_head too."""
        return sorted(batch for batch, captured in self._graphs.items() if captured.logits is not None)

    @property
    def eager_batch_sizes(self) -> list[int]:
        """The batch sizes whose capture failed."""
        return sorted(self._eager)

    def forward(self, model: CausalLM, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The step's hidden states and logits (of every token; None where the graph ends
        before the lm_head) through a graph, or None: run this step eagerly."""
        metadata = inputs.metadata
        batch = metadata.num_reqs
        if metadata.num_actual_tokens != batch or batch > self._max_batch_size or batch in self._eager:
            return None
        captured = self._graphs.get(batch)
        if captured is None:
            return self._capture_step(model, inputs)
        if not captured.load(inputs, metadata.backend_data):
            return None
        if self.kernel_profile is not None and (timed_replay := getattr(captured.graph, "profile", None)):
            self.kernel_profile.add(timed_replay())
        else:
            captured.graph.replay()
        return captured.hidden, captured.logits

    def _capture_step(self, model: CausalLM, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        batch = inputs.metadata.num_reqs
        metadata = _static_metadata(inputs.metadata, self._max_blocks)
        metadata.backend_data = self._backend.prepare(metadata)
        input_ids, positions = inputs.input_ids.clone(), inputs.positions.clone()

        def with_logits() -> tuple[torch.Tensor, ...]:
            hidden = model(input_ids, positions, metadata)
            return hidden, model.compute_logits(hidden)

        def forward_only() -> tuple[torch.Tensor, ...]:
            return (model(input_ids, positions, metadata),)

        # The lm_head alone may be what cannot be captured (a compute_logits that computes
        # in torch, such as a logit soft-cap): the layers still pay off without it. Each try is a whole step; rerunning one
        # rewrites the same keys and values into the same cache slots.
        reasons = []
        for run in (with_logits, forward_only):
            try:
                graph, outputs = self._capture.capture_step_graph(run, self._pool, batch)
                break
            except StepGraphUnsupported as exc:
                reasons.append(str(exc))
        else:
            logger.info("decode batches of %d run eagerly: %s", batch, reasons[-1])
            self._eager.add(batch)
            return None
        if reasons:
            logger.info("the lm_head of decode batches of %d runs outside their graph: %s", batch, reasons[0])
        hidden, logits = outputs[0], outputs[1] if len(outputs) > 1 else None
        backend_tensors: list[torch.Tensor] = []
        layout = _layout(metadata.backend_data, backend_tensors)
        self._graphs[batch] = _Captured(graph, hidden, logits, input_ids, positions, metadata, backend_tensors,
                                        layout)
        return hidden, logits


def _static_metadata(metadata: AttentionMetadata, max_blocks: int) -> AttentionMetadata:
    """A copy the graph owns, its block table padded to the widest a sequence can need."""
    table = metadata.block_table
    wide = torch.zeros((table.shape[0], max(max_blocks, table.shape[1])), dtype=table.dtype, device=table.device)
    wide[:, : table.shape[1]] = table
    copies = {name: getattr(metadata, name).clone() for name in _METADATA_TENSORS}
    return dataclasses.replace(metadata, block_table=wide, backend_data=None, **copies)


def _layout(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its shape and dtype (appended to ``tensors``
    in order), for comparing two steps' backend data; None for a type it cannot compare.
    Every replay runs it: the common types are tested first."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if value is None or isinstance(value, int | float | str | bool):
        return value
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_layout(v, tensors) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _layout(v, tensors)) for k, v in value.items()))
    if isinstance(value, np.ndarray):
        return ("array", value.shape, value.dtype.str, value.tobytes())
    names = _dataclass_fields(type(value))
    if names is not None:
        return (type(value).__name__, tuple(_layout(getattr(value, name), tensors) for name in names))
    return object()  # never equal to another: steps with such backend data run eagerly


_FIELD_NAMES: dict[type, tuple[str, ...] | None] = {}


def _dataclass_fields(cls: type) -> tuple[str, ...] | None:
    """The field names of a dataclass type (None for another type), looked up once per type."""
    if cls not in _FIELD_NAMES:
        _FIELD_NAMES[cls] = (tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls)
                             else None)
    return _FIELD_NAMES[cls]
