"""The model runner's side of speculative decoding: place the scheduled drafts in the batch,
verify them from the step's forward (logits only at the positions that verify), and ask the
proposer for the next step's drafts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.sample import Sampler, SamplingMetadata, apply_token_bitmask, compute_logprobs, gather_logprobs
from tokenmill.sample.rejection_sampler import rejection_sample
from tokenmill.scheduler.output import GrammarBitmask, ModelRunnerOutput
from tokenmill.spec_decode.proposer import DraftRequest, Proposer, TargetHiddenStates

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import InputBatch
    from tokenmill.worker.model_runner import ModelRunner
    from tokenmill.worker.request_state import CachedRequestState
    from tokenmill.worker.step_inputs import StepInputs


class SpecDecodeRunner:
    """Owns a runner's proposer and the drafts of the step in flight."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.drafts: dict[str, list[int]] = {}  # this step's, by request
        self.no_drafts: set[str] = set()  # this step's requests not to propose for (the scheduler would drop them)
        # the distributions sampled drafts were drawn from, by request: (drafts, q [k, V])
        self.draft_probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    def place_drafts(self, batch: InputBatch, drafts: dict[str, list[int]], no_drafts: set[str] | None = None) -> None:
        """Write each request's drafts after its last token, where the step's inputs read them
        (``num_tokens`` unchanged: they are not the request's until accepted); ``no_drafts``: the
        requests not to propose for after this step."""
        self.drafts = drafts
        self.no_drafts = no_drafts or set()
        for req_id, tokens in drafts.items():
            row = batch.index_of[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start : start + len(tokens)] = tokens

    def forget(self, req_ids: set[str]) -> None:
        if req_ids:
            self.proposer.forget(req_ids)
            for req_id in req_ids:
                self.draft_probs.pop(req_id, None)

    def verify(self, runner: ModelRunner, inputs: StepInputs, hidden: torch.Tensor, mask: np.ndarray,
               output: ModelRunnerOutput, grammar: GrammarBitmask | None = None) -> np.ndarray:
        """Verify the drafts of the rows in ``mask`` that carry some; returns ``mask`` without
        them (the rows left to the ordinary sampler). A constrained request's positions are
        masked by its grammar's rows for them (``grammar.draft_rows``) first."""
        batch = runner.batch
        with_drafts = mask & np.array([batch.req_ids[r] in self.drafts for r in inputs.rows], dtype=bool)
        if not with_drafts.any():
            return mask
        steps = np.flatnonzero(with_drafts)
        states = [batch.states[inputs.rows[i]] for i in steps]
        drafts = [self.drafts[s.req_id] for s in states]
        ends = inputs.query_start[1:][steps]
        positions = np.concatenate([np.arange(end - len(d) - 1, end) for end, d in zip(ends, drafts, strict=True)])
        raw = runner.compute_logits(hidden, torch.from_numpy(positions).to(runner.device)).float()
        metadata = _position_metadata(runner, states, drafts)
        logits = Sampler.apply_logits_processors(_masked_by_grammar(raw.clone(), grammar, states, drafts), metadata)
        q = self._verified_draft_probs(states, drafts, logits)
        result = rejection_sample(logits, metadata, drafts, [s.generator for s in states], q)
        logprob_lists = None
        if metadata.max_num_logprobs is not None:
            logprob_lists = gather_logprobs(compute_logprobs(raw), result.position_tokens,
                                            metadata.max_num_logprobs).tolists()
        from tokenmill.worker.model_runner import _token_logprobs

        first = 0
        for i, state, tokens, draft in zip(steps, states, result.token_ids, drafts, strict=True):
            row = int(inputs.rows[i])
            for token in tokens:
                state.output_token_ids.append(token)
                batch.append_token(row, token)
            output.sampled[state.req_id] = tokens
            wanted = state.sampling_params.logprobs
            if logprob_lists is not None and wanted is not None:
                output.logprobs[state.req_id] = [_token_logprobs(logprob_lists, first + j, wanted)
                                                 for j in range(len(tokens))]
            first += len(draft) + 1
        return mask & ~with_drafts

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose hidden states the proposer reads instead of the final ones
        (EAGLE-3), or none."""
        return tuple(getattr(self.proposer, "target_layer_ids", ()))

    def propose(self, batch: InputBatch, output: ModelRunnerOutput, inputs: StepInputs | None = None,
                hidden: torch.Tensor | None = None, aux_hidden: torch.Tensor | None = None) -> None:
        """Drafts for every request that sampled this step, into ``output.spec_token_ids``; a
        proposer that drafts from the target's hidden states first gets those of the step (the
        layers it names, ``aux_hidden``, where it names some)."""
        if self.target_layer_ids:
            hidden = aux_hidden
        if inputs is not None and hidden is not None and getattr(self.proposer, "uses_target_hidden_states", False):
            self.proposer.observe(self._held_hidden_states(batch, inputs, hidden, output))  # type: ignore[attr-defined]
        requests = []
        for req_id in output.sampled:
            if req_id in self.no_drafts:  # paused by the off-switch, or a batch too large to draft for
                self.draft_probs.pop(req_id, None)
                continue
            row = batch.index_of.get(req_id)
            if row is None:
                continue
            num_tokens = int(batch.num_tokens[row])
            room = batch.max_model_len - num_tokens
            if room > 0:
                requests.append(DraftRequest(req_id, batch.token_ids[row, :num_tokens], min(self.k, room),
                                             batch.states[row].sampling_params))
        if not requests:
            return
        for request, draft in zip(requests, self.proposer.propose(requests), strict=True):
            self.draft_probs.pop(request.req_id, None)
            if draft:
                output.spec_token_ids[request.req_id] = [int(t) for t in draft[: request.num_drafts]]
        take = getattr(self.proposer, "take_draft_probs", None)
        if take is not None:
            for req_id, q in take().items():
                if req_id in output.spec_token_ids:
                    self.draft_probs[req_id] = (output.spec_token_ids[req_id], q)

    def _verified_draft_probs(self, states: list[CachedRequestState], drafts: list[list[int]],
                              logits: torch.Tensor) -> torch.Tensor | None:
        """``q`` ``[N, V]`` over the verified positions (the rows of each request's drafts,
        then a zero row for its last position), or None where no draft was sampled: the
        rejection sampler then takes every draft as one-hot. A request whose drafts came
        without ``q`` (greedy) gets the one-hot on its drafts."""
        held = [self.draft_probs.pop(s.req_id, None) for s in states]
        if all(h is None for h in held):
            return None
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        first = 0
        for draft, entry in zip(drafts, held, strict=True):
            rows = torch.arange(first, first + len(draft), device=logits.device)
            if entry is not None and entry[0][: len(draft)] == draft:
                width = min(q.shape[1], entry[1].shape[1])
                q[first : first + len(draft), :width] = entry[1][: len(draft), :width].to(q.device)
            else:
                q[rows, torch.tensor(draft, dtype=torch.int64, device=logits.device)] = 1.0
            first += len(draft) + 1
        return q


    def _held_hidden_states(self, batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor,
                            output: ModelRunnerOutput) -> list[TargetHiddenStates]:
        """Per scheduled request, the hidden states of its positions whose tokens hold: all of a
        prefill chunk's, and of a verifying row the last token's and the accepted drafts'."""
        states = []
        for i, row in enumerate(inputs.rows):
            req_id = batch.req_ids[row]
            if batch.samples_nothing[row]:
                continue
            count = int(inputs.num_scheduled[i])
            if req_id in self.drafts:
                count = len(output.sampled.get(req_id, ()))  # the accepted drafts and the token before them
            if count:
                first = int(inputs.query_start[i])
                states.append(TargetHiddenStates(req_id, int(inputs.context_lens[i]), hidden[first : first + count]))
        return states


def _masked_by_grammar(logits: torch.Tensor, grammar: GrammarBitmask | None, states: list[CachedRequestState],
                       drafts: list[list[int]]) -> torch.Tensor:
    """``logits`` (one row per verified position) with each constrained request's positions
    masked by its grammar's row for that position."""
    if grammar is None or not grammar.draft_rows:
        return logits
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    first = 0
    for state, draft in zip(states, drafts, strict=True):
        rows = grammar.draft_rows.get(state.req_id)
        if rows is not None:
            logit_rows += range(first, first + len(rows))
            mask_rows += rows
        first += len(draft) + 1
    if not logit_rows:
        return logits
    return apply_token_bitmask(logits, grammar.bitmask[mask_rows], logit_rows)


def _position_metadata(runner: ModelRunner, states: list[CachedRequestState],
                       drafts: list[list[int]]) -> SamplingMetadata:
    """One metadata row per verified position: the request's parameters, and its output so far
    with the drafts before that position (penalties and min-tokens see what precedes it)."""
    params, outputs, prompts, eos = [], [], [], []
    for state, draft in zip(states, drafts, strict=True):
        for j in range(len(draft) + 1):
            params.append(state.sampling_params)
            outputs.append(state.output_token_ids + draft[:j])
            prompts.append(state.prompt_token_ids)
            eos.append(state.eos_token_id)
    return SamplingMetadata.from_params(params=params, output_token_ids=outputs, prompt_token_ids=prompts,
                                        generators={}, eos_token_ids=eos, vocab_size=runner.vocab_size,
                                        device=runner.device)
