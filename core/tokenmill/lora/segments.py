"""Segment LoRA (in the manner of punica's SGMV): the step's adapter tokens sorted by slot, so
each slot's tokens form one segment and a grouped matmul multiplies every segment by its own
slot's A (then B) in one call.

The dense path (:meth:`tokenmill.lora.layers.LoRAWeights.delta_into`) shrinks every token
against every slot's A and masks all but its own: ``num_slots`` times the work it keeps, and
base-model tokens pay as much as adapter ones. Here a token meets only its own slot's matrices
and a base token none: gather the adapter tokens in slot order, ``grouped_mm`` against the
slot-stacked A viewed ``[num_slots, in, C]``, ``grouped_mm`` against B viewed ``[num_slots, C,
out]``, and add each row back to its token (``index_add_``). The order and segment ends are
computed once per step (:func:`slot_segments`), shared by every layer; no Python loop over
adapters. It needs ``torch.nn.functional.grouped_mm`` (torch 2.9 on) taking the layer's dtype
and shapes on its device, probed once per layer shape (:func:`grouped_mm_works`); where it
cannot, the dense path runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SlotSegments:
    """The step's adapter tokens in slot order (``order`` [L] int64, indices into the step's
    tokens) and where each slot's segment ends in that order (``ends`` [num_slots] int32,
    cumulative; an unused slot's segment is empty)."""

    order: torch.Tensor
    ends: torch.Tensor

    def to(self, device: torch.device) -> SlotSegments:
        return SlotSegments(self.order.to(device), self.ends.to(device))


def slot_segments(token_slots: torch.Tensor, num_slots: int) -> SlotSegments:
    """The segments of ``token_slots`` ([T], -1: the base model), on its device."""
    adapter_tokens = torch.nonzero(token_slots >= 0)[:, 0]
    slots = token_slots[adapter_tokens].long()
    order = adapter_tokens[torch.argsort(slots, stable=True)]
    ends = torch.cumsum(torch.bincount(slots, minlength=num_slots), 0).to(torch.int32)
    return SlotSegments(order, ends)


def grouped_delta_into(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       num_slots: int, segments: SlotSegments,
                       reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``out[t] += B_s (A_s x[t])`` for each adapter token ``t`` of slot ``s`` (A/B slot-stacked
    as :class:`~tokenmill.lora.layers.LoRAWeights` holds them); ``reduce``: a function applied to
    the shrunk activations before the expand (a row-parallel layer's all-reduce)."""
    columns = lora_a.shape[0] // num_slots
    a_groups = lora_a.view(num_slots, columns, lora_a.shape[1]).transpose(1, 2)  # [S, in, C]
    b_groups = lora_b.view(lora_b.shape[0], num_slots, columns).permute(1, 2, 0)  # [S, C, out]
    shrunk = F.grouped_mm(x.index_select(0, segments.order), a_groups, offs=segments.ends)
    if reduce is not None:
        shrunk = reduce(shrunk)
    return out.index_add_(0, segments.order, F.grouped_mm(shrunk, b_groups, offs=segments.ends))


@functools.cache
def grouped_mm_works(device: torch.device, dtype: torch.dtype, num_slots: int, columns: int, in_features: int,
                     out_features: int) -> bool:
    """Whether ``grouped_mm`` takes these slot-stacked shapes on ``device`` in ``dtype`` (its
    kernels have layout rules, e.g. 16-byte strides for bfloat16), and gives the per-slot product."""
    if not hasattr(F, "grouped_mm"):
        return False
    generator = torch.Generator().manual_seed(0)
    lora_a = torch.randn(num_slots * columns, in_features, generator=generator).to(device, dtype)
    lora_b = torch.randn(out_features, num_slots * columns, generator=generator).to(device, dtype)
    x = torch.randn(2, in_features, generator=generator).to(device, dtype)
    slots = torch.tensor([num_slots - 1, -1], device=device)
    try:
        out = grouped_delta_into(x, torch.zeros(2, out_features, device=device, dtype=dtype), lora_a, lora_b,
                                 num_slots, slot_segments(slots, num_slots))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    first = slice((num_slots - 1) * columns, num_slots * columns)
    expected = (x[0].float() @ lora_a[first].float().T) @ lora_b[:, first].float().T
    return bool(out[1].eq(0).all()) and torch.allclose(out[0].float(), expected, rtol=1e-2, atol=1e-2 * columns)
