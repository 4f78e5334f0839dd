"""Batched LoRA on a base linear layer: every slot's adapter in one pass over a mixed batch.

Each wrapped layer holds the A and B matrices of ``num_slots`` adapters, zero-padded to
``max_rank``, stacked so that one matmul covers them all (in the manner of punica's BGMV,
as dense ops): shrink ``x @ A_all.T`` gives every token its projection onto every slot's
rank space, a per-token one-hot mask over the slots keeps only the token's own adapter (and
zeroes base-model tokens), and expand ``@ B_all.T`` adds ``x A_s^T B_s^T`` (scaling folded
into B). A merged layer (q/k/v, gate/up) keeps one A block per output slice and a B that is
block-diagonal over the slices, so each checkpoint module's matrices land in its slice. Different ranks share a batch: a
smaller rank's padding rows are zero. The cost is ``num_slots * max_rank`` extra columns per
layer, no gather of per-token weights and no Python loop over adapters; a batch with no
adapter skips it altogether.

Under tensor parallelism each rank holds its part of every adapter, split as the base layer
is: a column-parallel layer (q/k/v, gate/up) keeps A whole and the rows of B for its slice of
each output shard; a row-parallel layer (o, down) keeps the columns of A for its slice of the
input and B whole, and all-reduces the shrunk ``x A^T`` (``num_slots * max_rank`` columns: far
less than the output) before the expand, since the base output it adds to is already reduced.

A platform may bring a kernel that does shrink and expand in one call by each token's slot
(:class:`LoRADeltaOps`, found on its layer ops: the CPU's C++ one). Decode-sized steps take it;
since a step graph can record it, LoRA steps then keep their step graphs
(:meth:`tokenmill.lora.model_slots.LoRAModelSlots.enable_step_graphs`).

The layer's forward gets a hook; the model's own code is untouched.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Protocol, cast

import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.ops import layer_ops
from tokenmill.lora.adapter import LoRAModuleWeights
from tokenmill.lora.segments import SlotSegments, grouped_delta_into, grouped_mm_works

# Decode-sized steps (up to this many tokens) take a platform's LoRADeltaOps kernel outside a
# step graph too; longer ones (prefill chunks) the segment path, whose grouped matmuls run on BLAS.
KERNEL_MAX_TOKENS = 256


class LoRADeltaOps(Protocol):
    """A platform's fused LoRA kernel, an optional part of its layer ops (``tokenmill.layers.ops``).

    ``lora_delta_into`` adds ``B_s A_s x[t]`` to ``out[t]`` in place for each token ``t`` whose
    slot ``s = token_slots[t]`` is not -1 (int32 [T]), over a layer's slot-stacked ``lora_a``
    ``[num_slots * C, in]`` and ``lora_b_t`` ``[num_slots * C, out]`` (B transposed), where each
    output slice ``(offset, size)`` (``slices``, flattened) takes its ``C / len(slices)`` rank rows
    of a slot's ``C``; returns ``out``. It must read ``token_slots`` and the weights at every call
    and, if the platform captures step graphs, be one the graph records: a replay then applies the
    slots written into the same tensor since."""

    def lora_delta_supported(self, dtype: torch.dtype) -> bool: ...

    def lora_delta_into(self, x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor,
                        token_slots: torch.Tensor, num_slots: int, slices: list[int]) -> torch.Tensor: ...


def delta_kernel(device: torch.device, dtype: torch.dtype) -> LoRADeltaOps | None:
    """The platform's LoRA kernel for layers on ``device`` in ``dtype``, if it has one."""
    ops = layer_ops(device)
    supported = getattr(ops, "lora_delta_supported", None)  # optional: looked up, not subclassed
    if supported is None or not hasattr(ops, "lora_delta_into") or not supported(dtype):
        return None
    return cast(LoRADeltaOps, ops)


class LoRABatch:
    """The current step's per-token slot mask ``[T, num_slots]`` (None: no token has an
    adapter), shared by every wrapped layer; the model runner sets it before each forward.
    ``token_slots`` [T] int32 (-1: the base model) is the same by index, for the GPU kernel;
    ``active_slots`` the slots the step's tokens use (a layer none of whose adapters is among
    them skips its work; None: not known, every layer works).
    ``graph_step``: a decode step a step graph may capture or replay: every layer with a platform
    kernel runs it by ``token_slots`` (no mask), whatever adapters the step has, so that a
    captured graph holds every layer's LoRA call for the steps it is replayed for.

    The vocabulary layers (:mod:`tokenmill.lora.vocab_layers`) take their rows' mask once per
    use: the embedding the step's mask at its first lookup, the lm_head the rows the runner
    selected for its next logits (:meth:`select_logits_rows`)."""

    def __init__(self) -> None:
        self.token_mask: torch.Tensor | None = None
        self.token_slots: torch.Tensor | None = None
        self.active_slots: frozenset[int] | None = None
        self.segments: SlotSegments | None = None  # the adapter tokens by slot, for the segment path
        self.graph_step = False
        self._embedding_pending = False
        self._logits_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def set_step(self, mask: torch.Tensor | None, slots: torch.Tensor | None, active: frozenset[int] | None,
                 segments: SlotSegments | None = None, graph_step: bool = False) -> None:
        self.token_mask, self.token_slots, self.active_slots, self.segments = mask, slots, active, segments
        self.graph_step = graph_step
        self._embedding_pending = mask is not None
        self._logits_rows = None

    def uses_any(self, slots: set[int]) -> bool:
        """Whether the step's tokens use one of ``slots``."""
        return self.active_slots is None or not self.active_slots.isdisjoint(slots)

    def take_embedding_mask(self) -> torch.Tensor | None:
        """The step's mask for its first embedding lookup; None after it (or with no adapter)."""
        pending, self._embedding_pending = self._embedding_pending, False
        return self.token_mask if pending else None

    def select_logits_rows(self, rows: torch.Tensor | slice) -> None:
        """The next lm_head call computes the logits of the step's tokens ``rows``."""
        if self.token_mask is None:
            self._logits_rows = None
            return
        slots = self.token_slots[rows] if self.token_slots is not None else None
        self._logits_rows = (self.token_mask[rows], slots)

    def take_logits_rows(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The mask and slots of the rows selected for this lm_head call (None: none selected)."""
        rows, self._logits_rows = self._logits_rows, None
        return rows


class LoRAWeights(nn.Module):
    """The slot-stacked A/B of one linear layer (buffers: not model parameters).

    Column ``(slot * n + slice) * max_rank + j`` of the shrunk activations is rank row ``j`` of a
    slot's adapter on output slice ``slice``; B maps it to that slice's output rows only (B is
    block-diagonal over the slices), so shrink, mask and expand are three ops for any layer.
    """

    lora_a: torch.Tensor  # [num_slots * n * max_rank, in]
    lora_b: torch.Tensor  # [out, num_slots * n * max_rank]
    lora_b_t: torch.Tensor  # B transposed, [num_slots * n * max_rank, out]: the platform kernel's layout

    def __init__(self, layer: Linear, num_slots: int, max_rank: int, batch: LoRABatch, kernel: bool = True) -> None:
        super().__init__()
        self.num_slots, self.max_rank, self.batch = num_slots, max_rank, batch
        self.parallel, self.comm, self.loader = layer.parallel, layer.comm, layer.output_loader
        self.slices = [layer.shard_slice(i) for i in range(len(layer.output_partition_sizes))]
        self.filled: set[int] = set()  # slots whose adapter has weights in this layer
        device, dtype = layer_device_dtype(layer)
        columns = num_slots * len(self.slices) * max_rank
        self.register_buffer("lora_a", torch.zeros(columns, layer.in_features, device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(layer.out_features, columns, device=device, dtype=dtype),
                             persistent=False)
        # the segment path where grouped_mm takes this layer's shapes (the CPU's; CUDA has the Triton kernels)
        self.segmented = grouped_mm_works(device, dtype, num_slots, columns // num_slots, layer.in_features,
                                          layer.out_features)
        # the platform's fused kernel (``kernel``: wanted), not for a row-parallel layer under tensor
        # parallelism, whose all-reduce comes between the shrink and the expand
        self.kernel = (delta_kernel(device, dtype) if kernel and (self.parallel != "row" or self.comm.world_size == 1)
                       else None)
        self.kernel_slices = [value for piece in self.slices for value in piece]  # (offset, size) pairs, flat
        if self.kernel is not None:
            self.register_buffer("lora_b_t", torch.zeros(columns, layer.out_features, device=device, dtype=dtype),
                                 persistent=False)

    def set_slot(self, slot: int, slices: list[LoRAModuleWeights | None]) -> None:
        """Put one adapter's matrices (one per output slice, None where it has none) into ``slot``."""
        n, r_max = len(self.slices), self.max_rank
        self.filled.discard(slot)
        if any(weights is not None for weights in slices):
            self.filled.add(slot)
        for i, (weights, (offset, size)) in enumerate(zip(slices, self.slices, strict=True)):
            first = (slot * n + i) * r_max
            rows = self.lora_a[first : first + r_max]
            cols = self.lora_b[offset : offset + size, first : first + r_max]
            rows.zero_()
            cols.zero_()
            rows_t = self.lora_b_t[first : first + r_max, offset : offset + size] if self.kernel is not None else None
            if rows_t is not None:
                rows_t.zero_()
            if weights is not None:
                lora_a, lora_b = self._rank_part(i, weights)
                r = lora_a.shape[0]
                rows[:r].copy_(lora_a)
                cols[:, :r].copy_(lora_b)
                if rows_t is not None:
                    rows_t[:r].copy_(lora_b.T)

    def _rank_part(self, slice_index: int, weights: LoRAModuleWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one module's (whole, checkpoint-shaped) A and B."""
        lora_a, lora_b = weights.lora_a, weights.lora_b
        loader = self.loader
        if self.parallel == "column":
            parts = loader.shard_parts[slice_index] if loader.shard_parts else 1
            size = lora_b.shape[0] // parts  # fewer parts than ranks: a shard replicated (K/V heads)
            lora_b = lora_b.narrow(0, loader.rank * parts // loader.world_size * size, size)
        elif self.parallel == "row":
            size = lora_a.shape[1] // loader.world_size
            lora_a = lora_a.narrow(1, loader.rank * size, size)
        return lora_a, lora_b

    def delta_into(self, x: torch.Tensor, out: torch.Tensor, mask: torch.Tensor,
                   slots: torch.Tensor | None = None, segments: SlotSegments | None = None) -> torch.Tensor:
        """``out`` plus every token's adapter contribution, in place: by ``slots``, each token's
        slot index, where the GPU kernel runs, or the platform's kernel (:class:`LoRADeltaOps`) for up
        to ``KERNEL_MAX_TOKENS`` tokens; by ``segments`` (the tokens grouped by slot,
        :mod:`tokenmill.lora.segments`) where grouped_mm takes the layer; else by ``mask``."""
        kernels = _gpu_kernels() if x.is_cuda and slots is not None else None
        if kernels is not None and slots is not None:  # each token reads only its own slot's A and B
            y = kernels.lora_shrink(x, self.lora_a, slots, self.num_slots)
            if self.parallel == "row":
                y = self.comm.all_reduce(y)
            return kernels.lora_expand_into(y, self.lora_b, slots, out, self.num_slots)
        if self.kernel is not None and slots is not None and x.dim() == 2 and len(x) <= KERNEL_MAX_TOKENS:
            return self.kernel_delta_into(x, out, slots)
        if segments is not None and self.segmented:
            reduce = self.comm.all_reduce if self.parallel == "row" else None
            return grouped_delta_into(x, out, self.lora_a, self.lora_b, self.num_slots, segments, reduce)
        tokens = x.shape[0]
        shrunk = x @ self.lora_a.T
        if self.parallel == "row":  # each rank shrank its slice of the input: sum them
            shrunk = self.comm.all_reduce(shrunk)
        shrunk = shrunk.view(tokens, self.num_slots, -1) * mask[:, :, None]
        return out.addmm_(shrunk.view(tokens, -1), self.lora_b.T)

    def kernel_delta_into(self, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``out`` plus every token's adapter contribution by the platform's kernel (which this layer has)."""
        assert self.kernel is not None
        self.kernel.lora_delta_into(x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]), self.lora_a, self.lora_b_t,
                                    slots, self.num_slots, self.kernel_slices)
        return out


@functools.cache
def _gpu_kernels() -> ModuleType | None:
    """The Triton shrink/expand (:mod:`tokenmill.lora.triton_kernels`), if Triton is installed."""
    try:
        return importlib.import_module("tokenmill.lora.triton_kernels")
    except ImportError:
        return None


def layer_device_dtype(layer: Linear) -> tuple[torch.device, torch.dtype]:
    """Where the layer computes, and in what (a quantized layer's weight may be int8: its params dtype)."""
    tensors = list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False))
    device = tensors[0].device if tensors else torch.device("cpu")
    return device, layer.params_dtype


def _lora_hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    weights: LoRAWeights = module.lora  # type: ignore[assignment]
    batch = weights.batch
    if batch.graph_step and weights.kernel is not None and batch.token_slots is not None:
        # a step graph may be capturing this step: every layer records its call, whatever adapters
        # this step has, so that the graph holds it for the steps it is replayed for
        return weights.kernel_delta_into(args[0], output, batch.token_slots)
    if batch.token_mask is None or not batch.uses_any(weights.filled):
        return output  # no adapter in the step, or none of its adapters targets this layer
    return weights.delta_into(args[0], output, batch.token_mask, batch.token_slots, batch.segments)


def wrap_linear(layer: Linear, num_slots: int, max_rank: int, batch: LoRABatch) -> LoRAWeights:
    """Give ``layer`` slot-stacked LoRA weights and a forward hook that adds their contribution."""
    weights = LoRAWeights(layer, num_slots, max_rank, batch)
    layer.add_module("lora", weights)
    layer.register_forward_hook(_lora_hook)
    return weights
