"""A draft model run ``k`` steps per target step, with a KV cache of its own.

The draft runs in a :class:`~tokenmill.plugin_api.Worker` of its own (its own weights, its own
block table over its own KV tensors), driven with the same step diffs the engine drives the
target's worker with. Each call catches every request's draft KV up with the context (the
tokens the target accepted since), samples the first draft, then decodes ``k - 1`` more.
Where the target rejected drafts, the draft's KV is valid up to the context's common prefix
with what the draft computed, and recomputed from there.

Drafts are drawn at each request's sampling parameters (``draft_sampling_params``: its
temperature, top-k, top-p, min-p; a seed of its own per step for a seeded request) by a
:class:`~tokenmill.sample.draft_sampler.DraftSampler` in the draft's runner, which keeps the
distribution ``q`` each draft came from; ``take_draft_probs`` hands those to the rejection
sampler, which accepts with ``min(1, p/q)``. A greedy request drafts the argmax (a one-hot
``q``, left out of ``take_draft_probs``), as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.plugin_api import (
    CachedRequestData,
    DraftRequest,
    DraftSampler,
    EngineConfig,
    NewRequestData,
    ProposerContext,
    SchedulerOutput,
    SpeculativeConfig,
    Worker,
    WorkerSpec,
    draft_sampling_params,
    samples_drafts,
)


@dataclass
class _DraftState:
    blocks: list[int]
    computed: list[int] = field(default_factory=list)  # tokens whose KV the draft holds, in order


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        assert config.model is not None  # the engine checked it at start
        self.k = config.num_speculative_tokens
        self.block_size = context.block_size
        dtype = str(context.dtype).removeprefix("torch.")
        # the target's options (plugin options included), for another model without speculation
        base = context.engine_config if context.engine_config is not None else EngineConfig.model_validate({})
        engine_config = base.model_copy(update=dict(
            model=config.model, tokenizer=None, revision=None, quantization=None, dtype=dtype,
            max_model_len=context.max_model_len, block_size=context.block_size, max_num_seqs=context.max_num_seqs,
            enforce_eager=True, enable_prefix_caching=False, speculative_config=None))
        spec = WorkerSpec(model_path=config.model, config=engine_config, dtype=dtype,
                          max_model_len=context.max_model_len, plugins=())
        self.worker = Worker(spec, plugins=context.plugins, platform=context.platform)
        self.sampler = DraftSampler()
        self.worker.runner.sampler = self.sampler  # drafts drawn from q, and q kept
        blocks_per_request = -(-(context.max_model_len + self.k) // context.block_size)
        num_blocks = int(config.options.get("num_kv_blocks", blocks_per_request * min(context.max_num_seqs, 16)))
        self.worker.allocate_kv_cache(num_blocks)
        self.free_blocks = list(range(num_blocks))
        self.states: dict[str, _DraftState] = {}
        self._finished: set[str] = set()  # to drop from the draft's batch with the next step
        self._probs: dict[str, list[torch.Tensor]] = {}  # this call's q rows of sampled drafts, by request
        self._sampled: set[str] = set()  # this call's requests that draft by sampling

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self.free_blocks.extend(state.blocks)
                self._finished.add(req_id)

    def take_draft_probs(self) -> dict[str, torch.Tensor]:
        """The last call's ``q`` ``[num_drafts, V]`` per request whose drafts were sampled."""
        probs, self._probs = self._probs, {}
        return {req_id: torch.stack(rows) for req_id, rows in probs.items() if req_id in self._sampled and rows}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {}
        self._probs = {}
        self._sampled = {r.req_id for r in requests if samples_drafts(r.sampling_params)}
        first = self._catch_up(requests, drafts)
        active = [r for r in requests if r.req_id in drafts]
        for step in range(1, self.k):
            active = [r for r in active if r.num_drafts > step]
            if not active:
                break
            diffs = [CachedRequestData(r.req_id, False, [], len(r.token_ids) + step - 1) for r in active]
            self._run(SchedulerOutput(scheduled_cached_reqs=diffs, num_scheduled_tokens=dict.fromkeys(
                (r.req_id for r in active), 1), total_num_scheduled_tokens=len(active)), drafts)
        for request in requests:
            state = self.states.get(request.req_id)
            if state is not None and request.req_id in first:
                state.computed = [*request.token_ids.tolist(), *drafts[request.req_id][:-1]]
        # a draft whose q was lost (a draft row that failed to sample) ends its request's drafts
        return [drafts.get(r.req_id, [])[: len(self._probs.get(r.req_id, ())) if r.req_id in self._sampled else None]
                for r in requests]

    def _catch_up(self, requests: Sequence[DraftRequest], drafts: dict[str, list[int]]) -> set[str]:
        """Re-enter every request with its context, its valid draft KV counted as computed,
        and sample its first draft; a request the draft's KV cache has no room for gets none."""
        new, scheduled = [], {}
        finished, self._finished = self._finished, set()
        for request in requests:
            tokens = request.token_ids.tolist()
            state = self.states.get(request.req_id)
            if state is None:
                state = self.states[request.req_id] = _DraftState([])
            else:
                finished.add(request.req_id)
            needed = -(-(len(tokens) + self.k - 1) // self.block_size) - len(state.blocks)
            if needed > len(self.free_blocks):
                self.forget([request.req_id])
                continue
            state.blocks += [self.free_blocks.pop() for _ in range(max(0, needed))]
            valid = min(_common_prefix(state.computed, tokens), len(tokens) - 1)
            params = draft_sampling_params(request.sampling_params, len(tokens))
            new.append(NewRequestData(request.req_id, tokens, params, list(state.blocks), valid))
            scheduled[request.req_id] = len(tokens) - valid
        self._run(SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens=scheduled,
                                  total_num_scheduled_tokens=sum(scheduled.values()),
                                  finished_req_ids=finished), drafts)
        return set(scheduled)

    def _run(self, step: SchedulerOutput, drafts: dict[str, list[int]]) -> None:
        self.worker.execute_model(step)
        self.sampler.last_probs = None
        sampled = self.worker.sample_tokens(None).sampled
        probs = self.sampler.last_probs
        # q's rows follow the runner's sampled rows, as ``sampled`` does unless a row failed
        probs_known = probs is not None and len(probs) == len(sampled)
        for i, (req_id, tokens) in enumerate(sampled.items()):
            drafts.setdefault(req_id, []).extend(tokens)
            held = self._probs.setdefault(req_id, [])
            if probs_known and probs is not None and len(held) == len(drafts[req_id]) - 1:
                held.append(probs[i])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differs[0]) if len(differs) else n
