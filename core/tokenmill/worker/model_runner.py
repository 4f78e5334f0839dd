"""Runs the model for one scheduled step, in two calls: ``execute_model`` updates
the persistent batch from the scheduler's diffs, builds inputs and runs the
forward; ``sample_tokens`` (given the step's grammar bitmask, which the engine
builds meanwhile) computes logits only where a token is sampled, samples, and
remembers the sampled tokens."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from tokenmill.attention import AttentionBackend, KVCache
from tokenmill.kv_transfer.connector import KVConnectorOutput, KVConnectorWorker
from tokenmill.layers.attention import Attention
from tokenmill.lora.model_slots import LoRAModelSlots
from tokenmill.platform import DeviceKVAllocator, KVCacheAllocator
from tokenmill.sample import Sampler, SamplingMetadata, apply_grammar_bitmask, compute_prompt_logprobs
from tokenmill.scheduler.output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.model_interface import (
    AuxHiddenStatesCausalLM,
    CausalLM,
    is_multimodal,
    records_aux_hidden_states,
)
from tokenmill.worker.multimodal import MultiModalEmbedder
from tokenmill.worker.prefault import populate_in_background
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.spec_decode import SpecDecodeRunner
from tokenmill.worker.step_graphs import DecodeGraphs, StepGraphCapture
from tokenmill.worker.step_inputs import StepInputs, build_step_inputs

logger = logging.getLogger(__name__)


@dataclass
class _Forward:
    """A step's forward, waiting for ``sample_tokens``."""

    inputs: StepInputs
    hidden: torch.Tensor
    token_logits: torch.Tensor | None  # every token's logits, where a step graph computed them too
    aux_hidden: torch.Tensor | None = None  # the layers record_aux_hidden_states named, where it did


class ModelRunner:
    def __init__(self, model: CausalLM, backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
                 vocab_size: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 graph_capture: StepGraphCapture | None = None, max_graph_batch_size: int = 0,
                 kv_allocator: KVCacheAllocator | None = None, samples: bool = True,
                 mirrors_logits: bool = False, lora: LoRAModelSlots | None = None,
                 mm_encoder_cache_size: int = 0,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        """``graph_capture``: the platform, where it can capture step graphs and the backend
        allows them; decode batches of up to ``max_graph_batch_size`` requests then replay one.
        ``kv_allocator``: what makes the KV tensors (the platform's, or zeros on ``device``).
        ``samples``: false on the ranks other than 0, which run the forward and return nothing;
        they learn the sampled tokens from the scheduler's diffs (``CachedRequestData.new_token_ids``).
        ``mirrors_logits``: such a rank still computes the logits rank 0 computes (and drops
        them), since a tensor-parallel lm_head gathers from every rank.
        ``lora``: the model's LoRA slots, where LoRA is enabled.
        ``mm_encoder_cache_size``: the encoder cache's budget in embedding rows, for a
        multimodal model (:mod:`tokenmill.worker.multimodal`).

        ``kv_cache_dtype``: what the KV tensors are allocated in (None: ``dtype``; a float8
        dtype for an fp8 KV cache, which the backend quantises on write)."""
        self.model = model
        self.lora = lora
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.samples = samples
        self.mirrors_logits = mirrors_logits
        self.kv_allocator = kv_allocator or DeviceKVAllocator(device)
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        # The last batched step's rows and their sampling metadata: a function of the rows'
        # states alone (the output token lists it holds are the states' own, growing in
        # place), so consecutive steps of the same requests reuse it.
        self._last_sampling: tuple[list[CachedRequestState], SamplingMetadata] | None = None
        self._forward_result: _Forward | None = None  # from execute_model, for sample_tokens
        self.spec_decode: SpecDecodeRunner | None = None  # set where speculative decoding is on
        self._records_aux = False  # record_aux_hidden_states was called
        self.multimodal = (MultiModalEmbedder(cast(Any, model), mm_encoder_cache_size)
                           if is_multimodal(model) else None)
        self.kv_connector: KVConnectorWorker | None = None  # set by bind_kv_connector, with kv_transfer_config
        self._kv_connector_output: KVConnectorOutput | None = None  # from execute_model, for sample_tokens
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[KVCache] = []
        graph_batch = min(max_graph_batch_size, max_num_seqs)
        self.graphs = (DecodeGraphs(graph_capture, backend, graph_batch, self.batch.block_table.shape[1])
                       if graph_capture is not None and graph_batch > 0 else None)
        if self.graphs is not None and lora is not None and not lora.enable_step_graphs(graph_batch):
            self.graphs = None  # LoRA layers the graphs could not record

    # -- KV cache ----------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """One block of every layer, in bytes, as each layer's ``kv_cache_spec`` says."""
        return sum(a.kv_cache_spec.bytes_per_block(self.block_size, self.kv_cache_dtype) for a in self.attention_layers)

    def allocate_kv_cache(self, num_blocks: int, prefault_bytes: int = 0) -> None:
        """``prefault_bytes`` (from a ``KVCachePrefault`` platform, whose KV tensors are host
        memory): how much of the cache to fault in on a background thread, lowest block ids
        first (a fresh block pool hands those out first), so that the first requests do not
        pay for faulting in fresh pages."""
        self.kv_caches = []
        if self.graphs is not None:
            self.graphs.clear()  # they hold the caches they were captured on
        prefault_blocks = min(num_blocks, prefault_bytes // self.kv_bytes_per_block())
        for layer in self.attention_layers:
            cache = layer.kv_cache_spec.allocate(self.kv_allocator.allocate_kv_tensor, num_blocks, self.block_size,
                                                 self.kv_cache_dtype)
            layer.bind(self.backend, cache)
            self.kv_caches.append(cache)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        if prefault_blocks:
            tensors = list({id(t): t for cache in self.kv_caches for t in cache}.values())  # a latent pair is one tensor
            populate_in_background(
                [(t.data_ptr(), t[:prefault_blocks].nbytes) for t in tensors], owners=tensors)

    def bind_kv_connector(self, connector: KVConnectorWorker) -> None:
        """A KV connector's worker side: it loads before each forward, and each attention layer
        waits for its loads and offers its saves through it."""
        self.kv_connector = connector
        for index, layer in enumerate(self.attention_layers):
            layer.bind_kv_connector(connector, index)
        if self.kv_caches:
            connector.register_kv_caches(self.kv_caches)

    def free_kv_cache(self) -> None:
        """Drop this runner's references to the KV cache (the layers' bindings go with the next allocation)."""
        self.kv_caches.clear()
        if self.graphs is not None:
            self.graphs.clear()

    def record_aux_hidden_states(self, layer_ids: tuple[int, ...]) -> None:
        """Have every forward also record these layers' hidden states (an EAGLE-3 proposer's
        ``target_layer_ids``), handed to the proposer. Step graphs go: a replay would not run
        the Python that records them. A model that cannot is an error at start."""
        if not records_aux_hidden_states(self.model):
            raise ValueError(f"{type(self.model).__name__} does not record intermediate hidden states "
                             "(set_aux_hidden_state_layers), which this speculative method needs")
        cast(AuxHiddenStatesCausalLM, self.model).set_aux_hidden_state_layers(layer_ids)
        self._records_aux = True
        self.graphs = None

    # -- one step ------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Update the batch and run the step's forward; :meth:`sample_tokens` gives its output."""
        self._update_states(scheduler_output)
        if self.multimodal is not None:
            self.multimodal.begin_step(scheduler_output.scheduled_encoder_inputs, scheduler_output.free_encoder_hashes)
        if self.spec_decode is not None:
            self.spec_decode.place_drafts(self.batch, scheduler_output.scheduled_spec_decode_tokens,
                                          scheduler_output.no_draft_req_ids)
        self._forward_result = None
        if self.kv_connector is not None:  # loads start even in a step that runs no forward
            self.kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            self.kv_connector.start_load_kv()
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._finish_kv_transfers(scheduler_output)
            return
        inputs = build_step_inputs(self.batch, scheduler_output.num_scheduled_tokens, self.device)
        inputs.metadata.backend_data = self.backend.prepare(inputs.metadata)
        if self.lora is not None:
            self.lora.load(scheduler_output.lora_loads)
            self.lora.set_step([self.batch.states[row].lora_slot for row in inputs.rows], inputs.num_scheduled)
        hidden, token_logits = self._forward(inputs)
        aux_hidden = cast(AuxHiddenStatesCausalLM, self.model).take_aux_hidden_states() if self._records_aux else None
        self._forward_result = _Forward(inputs, hidden, token_logits, aux_hidden)
        self._finish_kv_transfers(scheduler_output)

    def _finish_kv_transfers(self, scheduler_output: SchedulerOutput) -> None:
        """After the forward: the connector's saves are written, its finished transfers collected."""
        if self.kv_connector is not None:
            self.kv_connector.wait_for_save()
            self._kv_connector_output = self.kv_connector.get_finished(scheduler_output.finished_req_ids)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """The last forward's output: sampled tokens (within ``grammar``), logprobs, embeddings.
        A rank that does not sample returns an empty one."""
        forward, self._forward_result = self._forward_result, None
        output = ModelRunnerOutput()
        output.kv_connector_output, self._kv_connector_output = self._kv_connector_output, None
        if forward is None:
            return output
        if not self.samples:
            if self.mirrors_logits:
                self._mirror_logits(forward.inputs, forward.hidden)
            return output
        self._prompt_logprobs(forward.inputs, forward.hidden, output)
        self._pool(forward.inputs, forward.hidden, output)
        self._sample(forward.inputs, forward.hidden, output, grammar, forward.token_logits)
        if self.multimodal is not None:
            output.encoder_cache_queries, output.encoder_cache_hits = self.multimodal.take_step_counts()
        if self.spec_decode is not None:
            self.spec_decode.propose(self.batch, output, forward.inputs, forward.hidden, forward.aux_hidden)
        return output

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
        """The logits of the step's tokens ``rows`` (of its hidden states ``hidden``): the lm_head's
        LoRA adapters, where enabled, learn the rows' slots first."""
        if self.lora is not None:
            self.lora.select_logits_rows(rows)
        return self.model.compute_logits(hidden[rows])

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states, and the logits of every token where a step graph computed them too."""
        if self.multimodal is not None:  # a step with image tokens runs eagerly, from embeddings
            mrope = self.multimodal.step_positions(inputs, self.batch)  # M-RoPE: the model's own positions
            if mrope is not None:
                inputs = dataclasses.replace(inputs, positions=mrope)
            embeds, inputs.metadata.bidirectional_blocks = self.multimodal.step_items(inputs, self.batch)
            if embeds is not None or inputs.positions.dim() > 1:
                return cast(Any, self.model)(inputs.input_ids, inputs.positions, inputs.metadata,
                                             inputs_embeds=embeds), None
        if self.graphs is not None and (self.lora is None or self.lora.graph_safe):
            replayed = self.graphs.forward(self.model, inputs)
            if replayed is not None:
                return replayed
        return self.model(inputs.input_ids, inputs.positions, inputs.metadata), None

    def _update_states(self, so: SchedulerOutput) -> None:
        if self.spec_decode is not None:
            self.spec_decode.forget(so.finished_req_ids | so.preempted_req_ids)
        # Sorted: a set's order follows the process's hash seed, and the removals' order sets the
        # rows the batch keeps; tensor-parallel ranks (separate processes) must lay out one batch.
        for req_id in sorted(so.finished_req_ids):
            self.batch.remove(req_id)
            self.requests.pop(req_id, None)
        for req_id in sorted(so.preempted_req_ids):
            self.batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=params,
                generator=self._generator(params.seed),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
                pooling=new.pooling,
                lora_slot=new.lora_slot,
                mm_inputs=list(new.mm_inputs),
            )
            self.requests[new.req_id] = state
            self.batch.add(state)
        for cached in so.scheduled_cached_reqs:
            self._update_cached(cached.req_id, cached.resumed_from_preemption, cached.new_block_ids,
                                cached.num_computed_tokens, cached.new_token_ids, cached.num_kept_blocks)

    def _update_cached(self, req_id: str, resumed: bool, new_block_ids: list[int], num_computed: int,
                       new_token_ids: list[int], num_kept_blocks: int = -1) -> None:
        state = self.requests[req_id]
        state.num_computed_tokens = num_computed
        missing = [] if self.samples else _missing_tokens(state, num_computed, new_token_ids)
        if resumed:
            state.output_token_ids.extend(missing)
            state.block_ids = list(new_block_ids)
            state.pooled_sum = None  # recomputed from the first token
            self.batch.add(state)
            return
        row = self.batch.index_of[req_id]
        if 0 <= num_kept_blocks < len(state.block_ids):  # blocks of rejected drafts went back to the pool
            del state.block_ids[num_kept_blocks:]
            self.batch.truncate_blocks(row, num_kept_blocks)
        state.block_ids.extend(new_block_ids)
        self.batch.append_blocks(row, new_block_ids)
        self.batch.num_computed_tokens[row] = num_computed
        for token in missing:
            state.output_token_ids.append(token)
            self.batch.append_token(row, token)

    def _generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, output: ModelRunnerOutput,
                grammar: GrammarBitmask | None = None, token_logits: torch.Tensor | None = None) -> None:
        mask = inputs.sample_mask
        if self.batch.num_samples_nothing:
            mask = mask & ~self.batch.samples_nothing[inputs.rows]
        if self.spec_decode is not None and self.spec_decode.drafts:  # rows with drafts verify them
            mask = self.spec_decode.verify(self, inputs, hidden, mask, output, grammar)
        sample_rows = inputs.rows[mask].tolist()  # ints: a numpy scalar is slow to index a list with
        if len(sample_rows) == 0:
            return
        indices = inputs.query_start[1:][mask] - 1
        # Sampling works in float32; converting first also keeps the max below off
        # bfloat16, for which torch's reduction is ~10x slower.
        logits = _sampled_logits(self.compute_logits, hidden, token_logits, indices, self.device).float()
        states = [self.batch.states[r] for r in sample_rows]
        apply_grammar_bitmask(logits, grammar, states)  # structured outputs: forbidden tokens -> -inf
        row_max = logits.amax(dim=-1)  # max propagates NaN: a broken row shows in it
        drawn = self._draw(logits, states, output)  # rows are independent: a NaN row spoils only itself
        failed = _unsampleable_rows(row_max)  # read after the draw, whose token copy has already synchronised
        for i, reason in failed.items():  # that request fails alone
            output.errors[states[i].req_id] = reason
        for i, (row, state) in enumerate(zip(sample_rows, states, strict=True)):
            draw = drawn[i]
            if i in failed or draw is None:
                continue
            token, lists, index = draw
            state.output_token_ids.append(token)
            self.batch.append_token(row, token)
            output.sampled[state.req_id] = [token]
            if lists is not None and state.sampling_params.logprobs is not None:
                output.logprobs[state.req_id] = [_token_logprobs(lists, index, state.sampling_params.logprobs)]

    def _draw(self, logits: torch.Tensor, states: list[CachedRequestState],
              output: ModelRunnerOutput) -> list[tuple[int, Any, int] | None]:
        """Per row: (token, logprob lists, row in them), or None for a row that failed.

        One batched draw; if that raises (one request's parameters that the sampler cannot
        take), each row is drawn alone, so only the requests at fault fail, not the step.
        """
        try:
            result = self.sampler(logits, self._batch_sampling_metadata(states))
        except Exception:
            logger.exception("batched sampling failed: drawing row by row to isolate the failing request(s)")
            return [self._draw_one(logits[i : i + 1], state, output) for i, state in enumerate(states)]
        tokens = result.sampled_token_ids.tolist()
        lists = result.logprobs.tolists() if result.logprobs is not None else None
        return [(token, lists, i) for i, token in enumerate(tokens)]

    def _draw_one(self, logits: torch.Tensor, state: CachedRequestState,
                  output: ModelRunnerOutput) -> tuple[int, Any, int] | None:
        try:
            result = self.sampler(logits, self._sampling_metadata([state]))
        except Exception as exc:
            output.errors[state.req_id] = f"sampling failed: {type(exc).__name__}: {exc}"
            return None
        lists = result.logprobs.tolists() if result.logprobs is not None else None
        return int(result.sampled_token_ids[0]), lists, 0

    def _batch_sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        last = self._last_sampling
        if last is not None and len(last[0]) == len(states) and all(
                a is b for a, b in zip(last[0], states, strict=True)):
            return last[1]
        metadata = self._sampling_metadata(states)
        self._last_sampling = (states, metadata)
        return metadata

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.from_params(
            params=[s.sampling_params for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            eos_token_ids=[s.eos_token_id for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
        )

    def _pool(self, inputs: StepInputs, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Embeddings: the last prompt position's final hidden state, the first's (``cls``), or
        the mean over the prompt; then the model's ``compute_pooled`` head where it has one (a
        classifier's logits), once for the step's finished requests.

        A prompt may arrive in chunks, so mean pooling keeps a running sum.
        """
        if not self.batch.num_pooling:
            return
        finished: list[tuple[str, torch.Tensor]] = []
        for i in np.flatnonzero(self.batch.is_pooling[inputs.rows]):
            state = self.batch.states[inputs.rows[i]]
            start, end = int(inputs.query_start[i]), int(inputs.query_start[i + 1])
            if state.pooling == "mean":
                chunk_sum = hidden[start:end].float().sum(0)
                state.pooled_sum = chunk_sum if state.pooled_sum is None else state.pooled_sum + chunk_sum
            elif state.pooling == "cls" and int(inputs.context_lens[i]) == 0:
                state.pooled_sum = hidden[start]
            if inputs.sample_mask[i]:
                vector = (state.pooled_sum / len(state.prompt_token_ids) if state.pooling == "mean"
                          else state.pooled_sum if state.pooling == "cls" else hidden[end - 1])
                finished.append((state.req_id, vector.float()))
        if not finished:
            return
        vectors = torch.stack([v for _, v in finished])
        head = getattr(self.model, "compute_pooled", None)
        if head is not None:
            vectors = head(vectors.to(hidden.dtype))
        for (req_id, _), vector in zip(finished, vectors.float().tolist(), strict=True):
            output.pooled[req_id] = vector

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        if not self.batch.num_prompt_logprobs:
            return
        for i, state, start, end in self._prompt_logprob_chunks(inputs):
            wanted = cast(int, state.sampling_params.prompt_logprobs)
            if end > start:
                flat = int(inputs.query_start[i])
                logits = self.compute_logits(hidden, slice(flat, flat + end - start)).float()
                next_ids = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
                lists = compute_prompt_logprobs(logits, next_ids, wanted).tolists()
                state.prompt_logprobs.extend(_token_logprobs(lists, j, wanted) for j in range(end - start))
            if start + int(inputs.num_scheduled[i]) >= len(state.prompt_token_ids):
                output.prompt_logprobs[state.req_id] = state.prompt_logprobs

    def _prompt_logprob_chunks(self, inputs: StepInputs) -> Iterator[tuple[int, CachedRequestState, int, int]]:
        """``(row in the step, request, first, end)``: the prompt positions whose logprobs
        this step computes, for each request that asked for prompt logprobs."""
        for i in np.flatnonzero(self.batch.wants_prompt_logprobs[inputs.rows]):
            state = self.batch.states[inputs.rows[i]]
            num_prompt = len(state.prompt_token_ids)
            start = int(inputs.context_lens[i])
            if state.sampling_params.prompt_logprobs is None or start >= num_prompt:
                continue
            yield int(i), state, start, min(start + int(inputs.num_scheduled[i]), num_prompt - 1)

    def _mirror_logits(self, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """On a rank that does not sample, compute (and drop) the logits rank 0 computes, in
        the same calls: a tensor-parallel lm_head gathers its slices from every rank."""
        for i, _state, start, end in self._prompt_logprob_chunks(inputs):
            if end > start:
                flat = int(inputs.query_start[i])
                self.compute_logits(hidden, slice(flat, flat + end - start))
        mask = inputs.sample_mask & ~self.batch.samples_nothing[inputs.rows]  # the rows _sample keeps
        if mask.any():
            rows = torch.from_numpy(inputs.query_start[1:][mask] - 1).to(self.device)
            self.compute_logits(hidden, rows)


def _missing_tokens(state: CachedRequestState, num_computed: int, new_token_ids: list[int]) -> list[int]:
    """Of the tokens the scheduler sent (those from position ``max(prompt, num_computed)`` on),
    the ones a rank that does not sample has not seen yet."""
    first = max(len(state.prompt_token_ids), num_computed)
    return new_token_ids[max(0, state.num_tokens - first):]


def _sampled_logits(logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    token_logits: torch.Tensor | None, indices: np.ndarray, device: torch.device) -> torch.Tensor:
    """The logits of the tokens at ``indices``: from a step graph's logits of every token
    (all of them, in a decode step where every request samples: no copy), or computed."""
    if token_logits is not None and len(indices) == len(token_logits):
        return token_logits  # indices are 0..T-1: one token per request, each sampling
    rows = torch.from_numpy(indices).to(device)
    if token_logits is not None:
        return token_logits[rows]
    return logits_of(hidden, rows)


def _unsampleable_rows(row_max: torch.Tensor) -> dict[int, str]:
    """Rows no token can be drawn from, by their largest logit: a NaN or +inf anywhere (a
    broken forward), or every logit -inf. One small copy to the host."""
    values = row_max.tolist()  # one torch call: a step's fixed cost is largely its count of them
    if math.isfinite(sum(values)):  # every row finite (a sum that overflows only checks them one by one)
        return {}
    failed = {}
    for i, value in enumerate(values):
        if math.isnan(value) or value == math.inf:
            failed[i] = "the model produced non-finite logits (NaN or inf) for this request"
        elif value == -math.inf:
            failed[i] = "every token's logit is -inf for this request: nothing can be sampled"
    return failed


def _token_logprobs(lists: Any, index: int, num_logprobs: int) -> TokenLogprobs:
    """The chosen token with its rank, then the ``num_logprobs`` most likely with theirs."""
    ids, logprobs, rank = lists.token_ids[index], lists.logprobs[index], lists.ranks[index]
    entries = [(ids[0], logprobs[0], rank)]
    entries += [(ids[k], logprobs[k], k) for k in range(1, min(num_logprobs, len(ids) - 1) + 1)]
    return entries
