"""The worker side of multimodal inputs: the encoder outputs a step's tokens need, merged
into its token embeddings.

A prompt's image tokens may be computed over several steps (chunked prefill cuts through
an image; a prefix-cache hit may cover its first part): each step takes the rows of the
encoder output that its own tokens cover. The encoder runs for the items the scheduler listed
in ``SchedulerOutput.scheduled_encoder_inputs`` (its per-step encoder budget chose them, and
its mirror of this cache knows the others are here); every other item comes from the
:class:`EncoderCache`. An item neither listed nor cached is still encoded, so the answer stays
right, but counted in ``unscheduled_encodes``: a broken promise of the scheduler's mirror.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from tokenmill.attention.item_blocks import BidirectionalBlock
from tokenmill.multimodal.encoder_cache import EncoderCache
from tokenmill.multimodal.inputs import MultiModalItem
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.model_interface import MRopeCausalLM, MultiModalCausalLM, uses_mrope
from tokenmill.worker.step_inputs import StepInputs


@dataclass
class _Slice:
    """Rows [lo, hi) of ``item``'s encoder output go to the step's flat tokens from ``flat``."""

    item: MultiModalItem
    req_id: str
    index: int  # the item's index in its request's ``mm_inputs``
    flat: int
    lo: int
    hi: int
    request: int = 0  # its request's row in the step (AttentionMetadata.block_table)


class MultiModalEmbedder:
    def __init__(self, model: MultiModalCausalLM, cache_size: int) -> None:
        self.model = model
        self.cache = EncoderCache(cache_size)
        self.mrope = uses_mrope(model)
        # Gemma 3: an item's tokens attend to each other both ways (tokenmill.attention.item_blocks)
        self.bidirectional_items = bool(getattr(model, "attends_within_items", False))
        self._reported = (0, 0)  # the cache's (queries, hits) at the last take_step_counts
        self._scheduled: set[tuple[str, int]] = set()  # (request, item index) to encode this step
        self.unscheduled_encodes = 0  # items encoded though the scheduler did not list them (should stay 0)
        self.max_step_encoded_tokens = 0  # most encoder input tokens one step encoded

    def begin_step(self, scheduled: dict[str, list[int]], freed: list[str]) -> None:
        """Drop the outputs the scheduler's mirror evicted; note the items this step encodes."""
        for key in freed:
            self.cache.pop(key)
        self._scheduled = {(req_id, index) for req_id, indices in scheduled.items() for index in indices}

    def take_step_counts(self) -> tuple[int, int]:
        """The cache's look-ups and hits since the last call (the step's, for the metrics)."""
        now = (self.cache.queries, self.cache.hits)
        counts = (now[0] - self._reported[0], now[1] - self._reported[1])
        self._reported = now
        return counts

    def step_items(self, inputs: StepInputs,
                   batch: InputBatch) -> tuple[torch.Tensor | None, list[BidirectionalBlock] | None]:
        """The step's input embeddings (``step_embeddings``) and, for a model whose items attend
        to themselves both ways, their blocks (``step_bidirectional_blocks``), from one walk over
        where the step's tokens meet its requests' items."""
        slices = _step_slices(inputs, batch)
        return self.step_embeddings(inputs, slices), self.step_bidirectional_blocks(slices)

    def step_embeddings(self, inputs: StepInputs, slices: list[_Slice]) -> torch.Tensor | None:
        """The step's input embeddings, with the encoder outputs in place of the image tokens;
        None when no scheduled token is an item's (the model embeds the ids itself)."""
        if not slices:
            return None
        outputs = self._encoder_outputs(slices)
        mask = np.zeros(int(inputs.query_start[-1]), dtype=bool)
        for s in slices:
            mask[s.flat:s.flat + s.hi - s.lo] = True
        rows = torch.cat([outputs[s.item.content_hash][s.lo:s.hi] for s in slices])
        is_multimodal = torch.from_numpy(mask).to(inputs.input_ids.device)
        return self.model.embed_input_ids(inputs.input_ids, rows, is_multimodal)

    def step_bidirectional_blocks(self, slices: list[_Slice]) -> list[BidirectionalBlock] | None:
        """For a model whose items attend to themselves both ways: where the step's item tokens
        sit, each attending to its whole item; None for any other model, or a step without items.
        The scheduler computes each item whole (``SchedulerConfig.whole_mm_items``): a step
        that holds only a part of one, whose end is not computed, cannot be run right."""
        if not self.bidirectional_items:
            return None
        blocks: list[BidirectionalBlock] = []
        for s in slices:
            if s.hi != s.item.length:
                raise RuntimeError(f"a step holds {s.item.modality} tokens {s.lo}..{s.hi} of {s.item.length} "
                                   "without the item's end, which its earlier tokens attend to")
            blocks.append(BidirectionalBlock(s.request, s.flat, s.flat + s.hi - s.lo, s.item.offset + s.lo,
                                             s.item.end))
        return blocks or None

    def step_positions(self, inputs: StepInputs, batch: InputBatch) -> torch.Tensor | None:
        """An M-RoPE model's positions for the step: ``[3, T]`` where a scheduled token is an
        item's, ``[T]`` (shifted by each request's decode offset) otherwise; None where no
        scheduled request has items (its positions are the plain ones) or the model has no M-RoPE."""
        if not self.mrope:
            return None
        positions: np.ndarray | None = None
        for i, row in enumerate(inputs.rows):
            state = batch.states[int(row)]
            if not state.mm_inputs:
                continue
            if state.mrope is None:  # once per request: the prompt and its items do not change
                state.mrope = cast(MRopeCausalLM, self.model).mrope_prompt_positions(state.prompt_token_ids,
                                                                                     state.mm_inputs)
            if positions is None:
                positions = np.broadcast_to(_plain_positions(inputs), (3, int(inputs.query_start[-1]))).copy()
            prompt, delta = state.mrope
            start, count, flat = int(inputs.context_lens[i]), int(inputs.num_scheduled[i]), int(inputs.query_start[i])
            index = np.arange(start, start + count)
            in_prompt = index < prompt.shape[1]
            positions[:, flat:flat + count] = np.where(in_prompt, prompt[:, np.minimum(index, prompt.shape[1] - 1)],
                                                       index + delta)
        if positions is None:
            return None
        device = inputs.positions.device
        if (positions[0] == positions[1]).all() and (positions[0] == positions[2]).all():
            return torch.from_numpy(positions[0].copy()).to(device)
        return torch.from_numpy(positions).to(device)

    def _encoder_outputs(self, slices: list[_Slice]) -> dict[str, torch.Tensor]:
        """Each item's whole encoder output, by content hash: cached, or encoded now (the
        scheduled ones in one ``embed_multimodal`` call)."""
        outputs: dict[str, torch.Tensor] = {}
        missing: dict[str, MultiModalItem] = {}
        scheduled: set[str] = set()
        for s in slices:
            key = s.item.content_hash
            if (s.req_id, s.index) in self._scheduled:
                scheduled.add(key)
            if key in outputs or key in missing:
                continue
            cached = self.cache.get(key)
            if cached is not None:
                outputs[key] = cached
            else:
                missing[key] = s.item
        if missing:
            self.unscheduled_encodes += len(missing.keys() - scheduled)
            self.max_step_encoded_tokens = max(self.max_step_encoded_tokens,
                                               sum(item.length for item in missing.values()))
            encoded = self.model.embed_multimodal(list(missing.values()))
            self.cache.encoded += len(missing)
            for (key, item), output in zip(missing.items(), encoded, strict=True):
                if output.shape[0] != item.length:
                    raise RuntimeError(f"the encoder gave {output.shape[0]} embeddings for a {item.modality} "
                                       f"of {item.length} placeholder tokens")
                outputs[key] = output
                self.cache.put(key, output)
        return outputs


def _plain_positions(inputs: StepInputs) -> np.ndarray:
    """Each scheduled token's index in its request, flat."""
    offsets = np.repeat(inputs.context_lens - inputs.query_start[:-1], inputs.num_scheduled)
    return np.asarray(offsets + np.arange(int(inputs.query_start[-1])), dtype=np.int64)


def _step_slices(inputs: StepInputs, batch: InputBatch) -> list[_Slice]:
    """Where the step's tokens meet the items of their requests, in flat token order."""
    slices: list[_Slice] = []
    for i, row in enumerate(inputs.rows):
        state = batch.states[int(row)]
        if not state.mm_inputs:
            continue
        start = int(inputs.context_lens[i])
        end = start + int(inputs.num_scheduled[i])
        for index, item in enumerate(state.mm_inputs):
            overlap = item.overlap(start, end)
            if overlap is not None:
                lo, hi = overlap
                slices.append(_Slice(item, state.req_id, index, int(inputs.query_start[i]) + lo - start, lo - item.offset,
                                     hi - item.offset, request=i))
    return slices
