"""EAGLE-1 drafting: the head reads the target's hidden states of the positions the target
computed (``observe``, every step) and, when a request has sampled, catches its KV up with
them, then proposes ``k`` tokens, feeding its own output back as the next hidden state (the
requests of a call together: one head call to catch up, one per draft step).

The head at position ``i`` takes ``(embedding of token i+1, target hidden state at i)``, so
it can run up to the position before the last token. Its KV of draft positions is dropped
after proposing: the next call recomputes those positions from the target's real hidden
states (rejected drafts never had any). A greedy request drafts the argmax (a one-hot ``q``);
a sampled one draws each draft from the head's distribution at its temperature and truncation
(:func:`~tokenmill.sample.draft_sampler.sample_drafts`, its own seed per step where the
request is seeded) and ``take_draft_probs`` hands that ``q`` to the rejection sampler.

A prefix-cache hit means the target computed no hidden state for the hit's positions: the
head then starts at the first position it was given (its drafts see less context, the output
is unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.plugin_api import (
    DraftRequest,
    ProposerContext,
    SamplingMetadata,
    SpeculativeConfig,
    TargetHiddenStates,
    draft_sampling_params,
    sample_drafts,
    samples_drafts,
)
from tokenmill_spec_eagle.checkpoint import (
    EAGLE1_LAYOUT,
    check_shapes,
    load_head,
    read_head,
    trained_for_another_target,
)
from tokenmill_spec_eagle.head import EagleHead, LayerKV


@dataclass
class _HeadState:
    """One request: head KV for positions ``start .. start + num_kv - 1``, then target hidden
    states not yet run through the head."""

    start: int
    caches: list[LayerKV]
    num_kv: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_kv + self.num_pending

    def cut(self, position: int) -> None:
        """Forget everything from ``position`` on (``start <= position <= end``)."""
        keep = position - self.start
        if keep < self.num_kv:
            self.num_kv = keep
            for cache in self.caches:
                cache.truncate(keep)
            self.pending, self.num_pending = [], 0
        elif keep < self.num_kv + self.num_pending:
            held = torch.cat(self.pending)[: keep - self.num_kv]
            self.pending, self.num_pending = [held], len(held)


class EagleProposer:
    uses_target_hidden_states = True

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        assert config.model is not None  # the engine checked it at start
        if context.target_model is None:
            raise ValueError("the eagle proposer needs the target model (its embedding and lm_head)")
        self.k = config.num_speculative_tokens
        self.vocab_size = context.vocab_size
        self.target = context.target_model
        self.embed = _target_embedding(context.target_model)
        self.head: Any = self._load_head(config, context).to(device=context.device, dtype=context.dtype).eval()
        self.device, self.dtype = context.device, context.dtype
        self.states: dict[str, _HeadState] = {}
        self._probs: dict[str, list[torch.Tensor]] = {}  # the last call's q rows of sampled drafts

    def _load_head(self, config: SpeculativeConfig, context: ProposerContext) -> torch.nn.Module:
        """The EAGLE-1 head of ``config.model``, checked against the target, on the CPU."""
        path = str(config.model)
        head_config, weights = read_head(path, EAGLE1_LAYOUT)
        target_hidden = int(self.embed.weight.shape[-1])
        if head_config.hidden_size != target_hidden:
            raise trained_for_another_target(path, EAGLE1_LAYOUT, head_config.hidden_size, target_hidden)
        check_shapes(path, EAGLE1_LAYOUT, weights, {"fc.weight": (target_hidden, 2 * target_hidden)})
        return load_head(lambda: EagleHead(head_config, context.max_model_len + self.k, fc_bias="fc.bias" in weights),
                         weights, path, EAGLE1_LAYOUT)

    def _head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads at a position, from the target's hidden states there (EAGLE-1:
        the final ones as they are; a copy, the runner's view goes)."""
        return hidden.to(self.dtype).clone()

    def _draft_tokens(self, hidden: torch.Tensor) -> list[int]:
        """The greedy draft read from each of the head's output rows (EAGLE-1: the target's lm_head)."""
        return [int(t) for t in self.target.compute_logits(hidden)[:, : self.vocab_size].argmax(-1).tolist()]

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, V]`` logits over the target's vocabulary the drafts are sampled from (EAGLE-1:
        the target's lm_head)."""
        return self.target.compute_logits(hidden)[:, : self.vocab_size].float()  # type: ignore[no-any-return]

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings the head reads (EAGLE-1: the target's)."""
        return self.embed(token_ids)  # type: ignore[no-any-return]

    def take_draft_probs(self) -> dict[str, torch.Tensor]:
        """The last call's ``q`` ``[num_drafts, V]`` per request whose drafts were sampled."""
        probs, self._probs = self._probs, {}
        return {req_id: torch.stack(rows) for req_id, rows in probs.items()}

    def _next_drafts(self, hidden: torch.Tensor, requests: list[DraftRequest],
                     generators: list[torch.Generator | None]) -> list[int]:
        """One draft per row of ``hidden`` (request ``requests[i]``): the argmax for greedy
        requests, as before; drawn from ``q`` for sampled ones, whose ``q`` rows are kept."""
        tokens = self._draft_tokens(hidden)
        sampled = [i for i, r in enumerate(requests) if samples_drafts(r.sampling_params)]
        if not sampled:
            return tokens
        params = [draft_sampling_params(requests[i].sampling_params, 0) for i in sampled]
        metadata = SamplingMetadata.from_params(
            params=params, output_token_ids=[[] for _ in sampled], prompt_token_ids=[[] for _ in sampled],
            generators={n: g for n, i in enumerate(sampled) if (g := generators[i]) is not None},
            eos_token_ids=[None] * len(sampled), vocab_size=self.vocab_size, device=self.device)
        drafts = sample_drafts(self._draft_logits(hidden[sampled]), metadata)
        for n, (i, token) in enumerate(zip(sampled, drafts.token_ids.tolist(), strict=True)):
            tokens[i] = int(token)
            self._probs.setdefault(requests[i].req_id, []).append(drafts.probs[n])
        return tokens

    def _generator(self, request: DraftRequest) -> torch.Generator | None:
        """A seeded sampled request's generator for this call's drafts (its draft seed mixes in
        the position, so successive calls draw fresh numbers)."""
        seed = draft_sampling_params(request.sampling_params, len(request.token_ids)).seed
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)

    def observe(self, states: Sequence[TargetHiddenStates]) -> None:
        for held in states:
            state = self.states.get(held.req_id)
            if state is None or not state.start <= held.start <= state.end:
                state = self.states[held.req_id] = _HeadState(
                    held.start, self.head.empty_caches(held.start, self.device, self.dtype))
            state.cut(held.start)
            state.pending.append(self._head_input(held.hidden))
            state.num_pending += len(held.hidden)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Every ready request's head catches up in one call, then each draft step runs the
        requests still drafting together; the drafts' KV is dropped after."""
        drafts: list[list[int]] = [[] for _ in requests]
        ready = [(i, r, state) for i, r in enumerate(requests)
                 if (state := self.states.get(r.req_id)) is not None and self._is_ready(r, state)]
        if not ready:
            return drafts
        self._probs = {}
        hidden = self._catch_up([(r, state) for _, r, state in ready])
        generators = [self._generator(r) for _, r, _ in ready]
        active = list(range(len(ready)))
        for step in range(max(r.num_drafts for _, r, _ in ready)):
            tokens = self._next_drafts(hidden, [ready[j][1] for j in active], [generators[j] for j in active])
            for j, token in zip(active, tokens, strict=True):
                drafts[ready[j][0]].append(int(token))
            keep = [n for n, j in enumerate(active) if ready[j][1].num_drafts > step + 1]
            if not keep:
                break
            active = [active[n] for n in keep]
            ids = torch.tensor([tokens[n] for n in keep], device=self.device)
            positions = torch.tensor([len(ready[j][1].token_ids) - 1 + step for j in active], device=self.device)
            hidden = self.head(self._embed(ids), hidden[keep], positions, [ready[j][2].caches for j in active],
                               [1] * len(active))
        for _, _, state in ready:  # the drafts' KV goes: recomputed from real hidden states next time
            for cache in state.caches:
                cache.truncate(state.num_kv)
        return drafts

    @staticmethod
    def _is_ready(request: DraftRequest, state: _HeadState) -> bool:
        """The target's hidden states reach the position before the last token, and some are new."""
        return state.end == len(request.token_ids) - 1 and state.num_pending > 0 and request.num_drafts > 0

    def _catch_up(self, ready: list[tuple[DraftRequest, _HeadState]]) -> torch.Tensor:
        """Run the head over every request's pending positions; returns its output at each
        request's last one (the hidden state its first draft is read from)."""
        tokens, hidden, positions, lengths = [], [], [], []
        for request, state in ready:
            first, last = state.start + state.num_kv, len(request.token_ids) - 1
            tokens.append(torch.as_tensor(request.token_ids[first + 1 : last + 1]))
            hidden += state.pending
            positions.append(torch.arange(first, last))
            lengths.append(last - first)
        out = self.head(self._embed(torch.cat(tokens).to(self.device)), torch.cat(hidden),
                        torch.cat(positions).to(self.device), [state.caches for _, state in ready], lengths)
        for _, state in ready:
            state.num_kv += state.num_pending
            state.pending, state.num_pending = [], 0
        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        return out[ends]


def _target_embedding(model: Any) -> Any:
    """The target's token embedding module (``get_input_embeddings()``, or ``model.embed_tokens``)."""
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        return getter()
    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    if embedding is None:
        raise ValueError(f"the eagle proposer cannot find the token embedding of {type(model).__name__}")
    return embedding
