"""The worker's side of LoRA: the model's wrapped layers and what each adapter slot holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.lora.adapter import LoRAAdapter, LoRAModuleWeights
from tokenmill.lora.layers import KERNEL_MAX_TOKENS, LoRABatch, LoRAWeights, wrap_linear
from tokenmill.lora.segments import slot_segments
from tokenmill.lora.targets import LoRATargetTable, lora_target_layers, lora_target_table, lora_vocab_layers
from tokenmill.lora.vocab_layers import wrap_embedding, wrap_lm_head


class _SlotWeights(Protocol):
    """A wrapped layer's adapter store (linear, embedding or lm_head)."""

    filled: set[int]  # the slots whose adapter has weights in this layer

    def set_slot(self, slot: int, slices: list[LoRAModuleWeights | None]) -> None: ...


class LoRAModelSlots:
    """Wraps every LoRA-capable layer of ``model`` with ``num_slots`` adapter slots of rank up
    to ``max_rank``. The scheduler decides which adapter goes into which slot
    (``SchedulerOutput.lora_loads``) and each request's slot; this copies adapters in and sets
    each step's per-token slot mask."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int) -> None:
        self.num_slots = num_slots
        self.batch = LoRABatch()
        self.targets: LoRATargetTable = lora_target_table(model)
        linear = [(wrap_linear(layer, num_slots, max_rank, self.batch), names)
                  for layer, names in lora_target_layers(model).values()]
        if not linear:
            raise ValueError(f"{type(model).__name__} has no layers LoRA can target")
        self.dtype = linear[0][0].lora_a.dtype
        self.device = linear[0][0].lora_a.device
        self._linear: list[LoRAWeights] = [weights for weights, _ in linear]
        self.layers: list[tuple[_SlotWeights, list[str]]] = list(linear)
        self._vocab: list[_SlotWeights] = []
        for prefix, module in lora_vocab_layers(model).items():
            self.layers.append((wrap_embedding(module, num_slots, max_rank, self.batch, self.device, self.dtype)
                                if isinstance(module, VocabEmbedding)
                                else wrap_lm_head(module, num_slots, max_rank, self.batch), [prefix]))
            self._vocab.append(self.layers[-1][0])
        self._graph_slots: torch.Tensor | None = None  # each decode token's slot, at one address: step graphs read it
        self.graph_safe = True  # the step may run through a step graph (none of its adapters is on a vocabulary layer)

    def enable_step_graphs(self, max_rows: int) -> bool:
        """Let decode steps of up to ``max_rows`` requests run through step graphs; False where they
        cannot: a wrapped linear layer without the platform's LoRA kernel, which the graph records
        (:class:`tokenmill.lora.layers.LoRADeltaOps`). Such a step writes its tokens' slots into one
        tensor that every captured graph reads, and every layer runs the kernel (a captured graph
        then holds every layer's call). A step whose adapters touch the embedding or the lm_head
        runs eagerly (:attr:`graph_safe`): those layers stay on the torch path."""
        if not all(weights.kernel is not None for weights in self._linear):
            return False
        self._graph_slots = torch.full((max_rows,), -1, dtype=torch.int32, device=self.device)
        return True

    def load(self, loads: Mapping[int, LoRAAdapter]) -> None:
        """Copy each adapter into its slot (a slot is only reassigned once no request uses it)."""
        for slot, adapter in loads.items():
            for weights, names in self.layers:
                weights.set_slot(slot, [adapter.modules.get(name) for name in names])

    def set_step(self, row_slots: Sequence[int], tokens_per_row: Sequence[int] | np.ndarray) -> None:
        """Each scheduled row's slot (-1: the base model) and its token count, in step order."""
        active = frozenset(slot for slot in row_slots if slot >= 0)
        self.graph_safe = all(active.isdisjoint(weights.filled) for weights in self._vocab)
        rows = len(row_slots)
        if (self._graph_slots is not None and self.graph_safe and rows <= len(self._graph_slots)
                and int(np.sum(tokens_per_row)) == rows):  # one token a row: a decode step a step graph may take
            slots = self._graph_slots[:rows]
            slots.copy_(torch.tensor(list(row_slots), dtype=torch.int32))  # in place: the graphs read it there
            self.batch.set_step(None, slots, active, graph_step=True)
            return
        if not active:
            self.batch.set_step(None, None, active)  # a base-only batch pays nothing
            return
        slots = torch.repeat_interleave(torch.tensor(list(row_slots)), torch.as_tensor(tokens_per_row))
        mask = torch.zeros(len(slots), self.num_slots + 1, dtype=self.dtype)
        mask[torch.arange(len(slots)), slots + 1] = 1  # column 0 catches the base rows
        kernel = len(slots) <= KERNEL_MAX_TOKENS and all(weights.kernel is not None for weights in self._linear)
        segments = None if kernel else slot_segments(slots, self.num_slots).to(self.device)  # the kernel needs none
        self.batch.set_step(mask[:, 1:].to(self.device), slots.to(self.device, torch.int32), active, segments)

    def select_logits_rows(self, rows: torch.Tensor | slice) -> None:
        """The next ``compute_logits`` is of the step's tokens ``rows`` (the lm_head applies their adapters)."""
        self.batch.select_logits_rows(rows)

    def clear_step(self) -> None:
        self.batch.set_step(None, None, frozenset())
