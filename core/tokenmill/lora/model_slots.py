"""The worker's side of LoRA: the model's wrapped layers and what each adapter slot holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.lora.adapter import LoRAAdapter, LoRAModuleWeights
from tokenmill.lora.layers import LoRABatch, wrap_linear
from tokenmill.lora.segments import slot_segments
from tokenmill.lora.targets import LoRATargetTable, lora_target_layers, lora_target_table, lora_vocab_layers
from tokenmill.lora.vocab_layers import wrap_embedding, wrap_lm_head


class _SlotWeights(Protocol):
    """A wrapped layer's adapter store (linear, embedding or lm_head)."""

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
        self.layers: list[tuple[_SlotWeights, list[str]]] = list(linear)
        for prefix, module in lora_vocab_layers(model).items():
            self.layers.append((wrap_embedding(module, num_slots, max_rank, self.batch, self.device, self.dtype)
                                if isinstance(module, VocabEmbedding)
                                else wrap_lm_head(module, num_slots, max_rank, self.batch), [prefix]))

    def load(self, loads: Mapping[int, LoRAAdapter]) -> None:
        """Copy each adapter into its slot (a slot is only reassigned once no request uses it)."""
        for slot, adapter in loads.items():
            for weights, names in self.layers:
                weights.set_slot(slot, [adapter.modules.get(name) for name in names])

    def set_step(self, row_slots: Sequence[int], tokens_per_row: Sequence[int] | np.ndarray) -> None:
        """Each scheduled row's slot (-1: the base model) and its token count, in step order."""
        active = frozenset(slot for slot in row_slots if slot >= 0)
        if not active:
            self.batch.set_step(None, None, active)  # a base-only batch pays nothing
            return
        slots = torch.repeat_interleave(torch.tensor(list(row_slots)), torch.as_tensor(tokens_per_row))
        mask = torch.zeros(len(slots), self.num_slots + 1, dtype=self.dtype)
        mask[torch.arange(len(slots)), slots + 1] = 1  # column 0 catches the base rows
        self.batch.set_step(mask[:, 1:].to(self.device), slots.to(self.device, torch.int32), active,
                            slot_segments(slots, self.num_slots).to(self.device))

    def select_logits_rows(self, rows: torch.Tensor | slice) -> None:
        """The next ``compute_logits`` is of the step's tokens ``rows`` (the lm_head applies their adapters)."""
        self.batch.select_logits_rows(rows)

    def clear_step(self) -> None:
        self.batch.set_step(None, None, frozenset())
