"""Batched LoRA on the vocabulary layers: the token embedding and the lm_head.

The embedding's adapter (PEFT's ``lora_embedding_A`` [r, vocab], ``lora_embedding_B``
[hidden, r]) adds ``B_s A_s[:, id]`` to the vector of token ``id`` on slot ``s``. Every slot's
``A^T`` is stacked into one ``[vocab, num_slots * max_rank]`` table, so the shrink is a lookup by
token id (one ``F.embedding``), then the per-token slot mask and one expand, as for a linear layer
(:mod:`tokenmill.lora.layers`). The lm_head's adapter is a linear one (``lora_A`` [r, hidden],
``lora_B`` [vocab, r]) on the rows that compute logits.

Which rows those are is the catch: the model runner computes logits on a few of the step's
tokens (those that sample, a prompt-logprob span, the drafts a verify scores), so it names the
rows first (:meth:`tokenmill.lora.model_slots.LoRAModelSlots.select_logits_rows`) and the
lm_head's hook reads their mask once. A call nobody named rows for (a draft head reusing the
target's lm_head or embedding, as EAGLE's does) gets the base layer: a draft is verified by the
target, which does apply the adapter. The embedding reads the step's mask once, at the step's
first lookup (the model's own forward, or a multimodal model's ``embed_input_ids``).

Under tensor parallelism both keep the adapter whole on every rank (the vocabulary is split, but
an adapter's part of it is small): the embedding adds the delta to the all-reduced vectors, and
the lm_head to the gathered logits (rank 0, which samples) or to the rank's own slice of them.

Extra vocabulary (an adapter that adds tokens: vLLM's former ``lora_extra_vocab_size``) is not
served; the loader refuses such an adapter by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.lm_head import ParallelLMHead
from tokenmill.lora.adapter import LoRAModuleWeights
from tokenmill.lora.layers import LoRABatch, LoRAWeights


class LoRAEmbeddingWeights(nn.Module):
    """The slot-stacked adapters of one token embedding (buffers, not model parameters):
    column ``slot * max_rank + j`` of both tables is rank row ``j`` of that slot's adapter."""

    lora_a: torch.Tensor  # [vocab, num_slots * max_rank]: every slot's A^T, looked up by token id
    lora_b: torch.Tensor  # [hidden, num_slots * max_rank]

    def __init__(self, embedding: VocabEmbedding, num_slots: int, max_rank: int, batch: LoRABatch,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_slots, self.max_rank, self.batch = num_slots, max_rank, batch
        self.filled: set[int] = set()  # slots whose adapter has weights here
        columns = num_slots * max_rank
        self.register_buffer("lora_a", torch.zeros(embedding.vocab_size, columns, device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(embedding.embedding_dim, columns, device=device, dtype=dtype),
                             persistent=False)

    def set_slot(self, slot: int, slices: list[LoRAModuleWeights | None]) -> None:
        """Put one adapter's matrices (``[weights]``, ``[None]`` where it has none) into ``slot``."""
        (weights,) = slices
        first = slot * self.max_rank
        columns_a = self.lora_a[:, first : first + self.max_rank]
        columns_b = self.lora_b[:, first : first + self.max_rank]
        columns_a.zero_()
        columns_b.zero_()
        self.filled.discard(slot)
        if weights is not None:
            r = weights.lora_a.shape[0]
            columns_a[:, :r].copy_(weights.lora_a.T)
            columns_b[:, :r].copy_(weights.lora_b)
            self.filled.add(slot)

    def delta_into(self, input_ids: torch.Tensor, out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``out`` (the base vectors) plus every token's adapter contribution, in place."""
        ids = input_ids.reshape(-1)
        shrunk = F.embedding(ids, self.lora_a).view(len(ids), self.num_slots, self.max_rank) * mask[:, :, None]
        out.view(len(ids), -1).addmm_(shrunk.view(len(ids), -1), self.lora_b.T)
        return out


class LoRAHeadWeights(LoRAWeights):
    """The slot-stacked adapters of the lm_head: a linear layer's, except that B holds the whole
    vocabulary on every rank (the hook sees the gathered logits, not the rank's slice)."""

    def __init__(self, head: ParallelLMHead, num_slots: int, max_rank: int, batch: LoRABatch) -> None:
        super().__init__(head, num_slots, max_rank, batch, kernel=False)  # the torch path, on the rows named
        self.vocab_size = head.vocab_size
        self.rank_start = head.output_loader.rank * head.out_features  # this rank's first vocabulary row
        self.slices = [(0, head.vocab_size)]
        if self.lora_b.shape[0] != head.vocab_size:  # split over ranks: keep every row
            self.register_buffer("lora_b", self.lora_b.new_zeros(head.vocab_size, self.lora_b.shape[1]),
                                 persistent=False)

    def _rank_part(self, slice_index: int, weights: LoRAModuleWeights) -> tuple[torch.Tensor, torch.Tensor]:
        return weights.lora_a, weights.lora_b  # whole: A's input (hidden) is never split, B is kept whole

    def head_delta_into(self, x: torch.Tensor, out: torch.Tensor, mask: torch.Tensor,
                        slots: torch.Tensor | None) -> torch.Tensor:
        """``out`` (logits of the whole vocabulary, or of this rank's slice) plus each row's adapter."""
        if out.shape[-1] == self.vocab_size:
            return self.delta_into(x, out, mask, slots)
        rows = max(0, min(out.shape[-1], self.vocab_size - self.rank_start))  # past the vocabulary: padding
        shrunk = (x @ self.lora_a.T).view(len(x), self.num_slots, -1) * mask[:, :, None]
        part = self.lora_b[self.rank_start : self.rank_start + rows]
        out[:, :rows].addmm_(shrunk.view(len(x), -1), part.T)
        return out


def _embedding_hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    weights: LoRAEmbeddingWeights = module.lora  # type: ignore[assignment]
    batch = weights.batch
    mask = batch.take_embedding_mask()
    if mask is None or not batch.uses_any(weights.filled):
        return output
    if args[0].numel() != mask.shape[0]:
        raise RuntimeError(f"the step's LoRA slot mask covers {mask.shape[0]} tokens, but its first embedding "
                           f"lookup has {args[0].numel()}")
    return weights.delta_into(args[0], output, mask)


def _head_hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    weights: LoRAHeadWeights = module.lora  # type: ignore[assignment]
    batch = weights.batch
    rows = batch.take_logits_rows()
    if rows is None or not batch.uses_any(weights.filled):
        return output
    mask, slots = rows
    if args[0].shape[0] != mask.shape[0]:
        raise RuntimeError(f"LoRA slots were selected for {mask.shape[0]} logits rows, but the lm_head got "
                           f"{args[0].shape[0]}")
    return weights.head_delta_into(args[0], output, mask, slots)


def wrap_embedding(embedding: VocabEmbedding, num_slots: int, max_rank: int, batch: LoRABatch,
                   device: torch.device, dtype: torch.dtype) -> LoRAEmbeddingWeights:
    """Give ``embedding`` slot-stacked LoRA tables and a forward hook that adds their contribution."""
    weights = LoRAEmbeddingWeights(embedding, num_slots, max_rank, batch, device, dtype)
    embedding.add_module("lora", weights)
    embedding.register_forward_hook(_embedding_hook)
    return weights


def wrap_lm_head(head: ParallelLMHead, num_slots: int, max_rank: int, batch: LoRABatch) -> LoRAHeadWeights:
    """Give ``head`` slot-stacked LoRA weights and a forward hook that adds them to the selected rows."""
    weights = LoRAHeadWeights(head, num_slots, max_rank, batch)
    head.add_module("lora", weights)
    head.register_forward_hook(_head_hook)
    return weights
