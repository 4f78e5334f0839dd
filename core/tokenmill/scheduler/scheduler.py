"""Continuous batching under a token budget.

Each step hands out at most ``max_num_batched_tokens`` tokens to at most
``max_num_seqs`` requests: running requests first (a decode is one token, an
unfinished prefill continues in chunks), then waiting ones. There are no
prefill and decode phases; chunked prefill and mixed batches fall out of the
budget. When the KV cache runs out, the newest (or lowest-priority) running
request is preempted and later recomputed from scratch.

A request with structured outputs waits in ``WAITING_FOR_GRAMMAR``, outside
the waiting queue, while its grammar compiles in a thread, so it blocks no
one; each step the constrained requests that sample get a token bitmask
(``grammar_bitmask``, built while the step's forward runs), and their
matchers advance with the tokens sampled.

A request with a LoRA adapter waits likewise in ``WAITING_FOR_LORA`` while its adapter
loads on a thread or every device slot holds another adapter that requests use; it joins
the waiting queue with a slot reserved, which it keeps until it finishes.

With a KV connector (``kv_transfer_config``), a waiting request whose prompt KV can be loaded
from outside gets blocks for it and waits in ``WAITING_FOR_REMOTE_KVS``, outside the waiting
queue, while the workers load it; it then joins the queue with those tokens computed, or, if
the load failed, to compute them itself (``tokenmill.kv_transfer.connector`` has the contract).

Under pipeline parallelism the engine core keeps up to ``steps_in_flight`` steps (micro-batches)
in flight, scheduling the next before the last one's output is back. A request is then in at
most one of them: a step skips the requests whose step is still in flight (their tokens are not
sampled yet), never preempts one (its step would come back for blocks that are gone), and takes
an even share of the requests, so that the micro-batches split them. An abort frees a request's
blocks at once even in flight: each worker runs its steps in order, so a later step that reuses
the blocks writes them after the aborted one did on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError, InvalidStateTransition
from tokenmill.kv_cache import KVCacheBlocks, KVCacheManager
from tokenmill.kv_cache.hashing import update_block_hashes
from tokenmill.kv_transfer.connector import KVConnectorOutput, ScheduledKVRequest
from tokenmill.metrics.stats import SchedulerSnapshot
from tokenmill.request import Request, RequestStatus
from tokenmill.scheduler.draft_backoff import DraftBackoff
from tokenmill.scheduler.encoder_budget import EncoderBudget
from tokenmill.scheduler.output import (
    CachedRequestData,
    EngineCoreOutput,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.scheduler.queues import QUEUES, WaitingQueue, preemption_key
from tokenmill.scheduler.spec_tokens import SpecDecodeCounters, num_rejected, usable_drafts

if TYPE_CHECKING:
    from tokenmill.kv_transfer.connector import KVConnectorScheduler
    from tokenmill.lora.manager import LoRAManager
    from tokenmill.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # An encoder attends every prompt token to every other: each prompt runs whole in one
    # step, never chunked (the input processor rejects one longer than the step's budget).
    non_causal_prefill: bool = False
    num_speculative_tokens: int = 0  # most draft tokens a request carries into a step (0: no speculation)
    # A request whose last spec_acceptance_window drafts had fewer accepted than this rate
    # decodes its next spec_backoff_tokens tokens without drafts (0: never).
    spec_min_acceptance_rate: float = 0.0
    spec_acceptance_window: int = 32
    spec_backoff_tokens: int = 32
    # No drafts while more requests than this run (0: never): speculative_config.disable_by_batch_size.
    spec_disable_by_batch_size: int = 0
    # Steps the engine core schedules before the first one's output is applied: one per pipeline
    # stage under pipeline parallelism (its micro-batches), else 1.
    steps_in_flight: int = 1
    # Multimodal: encoder input tokens (image placeholder rows) one step may encode (0: the
    # step's token budget), and the workers' encoder cache size in rows (scheduler/encoder_budget.py).
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # Items whose tokens attend to each other both ways (Gemma 3's images): no chunk ends inside
    # one (scheduler/whole_items.py).
    whole_mm_items: bool = False


@dataclass
class _StepPlan:
    """What one ``schedule()`` call has handed out so far."""

    budget: int
    new: list[NewRequestData]
    cached: list[CachedRequestData]
    tokens: dict[str, int]
    drafts: dict[str, list[int]] = field(default_factory=dict)  # the scheduled ones
    max_requests: int = 0  # most requests the step takes (0: no cap but max_num_seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 structured_output: StructuredOutputManager | None = None, lora: LoRAManager | None = None,
                 kv_connector: KVConnectorScheduler | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.structured_output = structured_output
        self.lora = lora
        self.waiting_for_lora: dict[str, Request] = {}
        self._lora_slots: dict[str, int] = {}  # request -> its reserved adapter slot
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue = QUEUES[config.policy]()
        self.waiting_for_grammar: dict[str, Request] = {}
        self.running: list[Request] = []
        self._constrained: dict[str, Request] = {}  # requests with a grammar matcher
        self._pending_outputs: list[EngineCoreOutput] = []  # ended outside a step, reported by the next
        self._victim_key = preemption_key(config.policy)
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self.num_preemptions = 0
        self.encoder_cache_queries = 0  # multimodal items looked up in the workers' encoder cache, since start
        self.encoder_cache_hits = 0
        self.encoder = EncoderBudget(config.max_num_encoder_input_tokens or config.max_num_batched_tokens,
                                     config.encoder_cache_size, whole_items=config.whole_mm_items)
        self.spec_decode = SpecDecodeCounters()
        self.draft_backoff = DraftBackoff(config.spec_min_acceptance_rate, config.spec_acceptance_window,
                                          config.spec_backoff_tokens)
        self.num_steps_drafting_off = 0  # steps with no drafts because of disable_by_batch_size, since start
        self.kv_connector = kv_connector
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        self._kv_loading: dict[str, int] = {}  # request -> its computed tokens once its load completes
        self._kv_loaded: set[str] = set()  # waiting with loaded KV in the blocks they hold
        self._kv_failed: set[str] = set()  # a load failed: compute the prompt, ask the connector no more
        self._kept_blocks: dict[str, Request] = {}  # finished, blocks kept for the connector to send
        self.num_external_hit_tokens = 0  # prompt tokens loaded through the connector, since start
        self._in_flight: set[str] = set()  # with steps_in_flight > 1: requests of steps whose output is not back

    # -- admission and removal ------------------------------------------
    def add_request(self, request: Request) -> None:
        if (request.request_id in self.requests or request.request_id in self._kept_blocks
                or request.request_id in self._in_flight):  # an aborted request's step still in flight
            raise ValueError(f"request id {request.request_id!r} is already in use")
        params = request.sampling_params.structured_outputs
        if params is not None:
            if self.structured_output is None:
                raise InvalidRequestError("this engine has no structured-output backend", param="structured_outputs")
            self.structured_output.submit(request)
            request.transition(RequestStatus.WAITING_FOR_GRAMMAR)
            self.requests[request.request_id] = request
            self.waiting_for_grammar[request.request_id] = request
            return
        if request.lora_name is not None:
            if self.lora is None:
                raise InvalidRequestError("this engine was started without enable_lora", param="lora_request")
            self.lora.get(request.lora_name)  # raises for an unknown adapter
            request.transition(RequestStatus.WAITING_FOR_LORA)
            self.requests[request.request_id] = request
            self.waiting_for_lora[request.request_id] = request
            return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (stop strings, aborts, timeouts).

        Unknown or already finished ids raise :class:`InvalidStateTransition`.
        """
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                raise InvalidStateTransition(f"request {req_id} is not running or waiting")
            waiting_for_grammar = request.status == RequestStatus.WAITING_FOR_GRAMMAR
            waiting_for_lora = request.status == RequestStatus.WAITING_FOR_LORA
            waiting_for_kv = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            request.transition(status)
            if waiting_for_kv:
                del self.waiting_for_remote_kvs[req_id]
                del self._kv_loading[req_id]
            elif waiting_for_lora:
                del self.waiting_for_lora[req_id]
            elif waiting_for_grammar:
                del self.waiting_for_grammar[req_id]
                assert self.structured_output is not None
                self.structured_output.discard(req_id)
            elif request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._release(request)
            finished.append(request)
        return finished

    def _release(self, request: Request) -> dict[str, Any] | None:
        """Free a finished request's state; the connector's ``kv_transfer_params`` for its answer, if any."""
        req_id = request.request_id
        self._kv_loaded.discard(req_id)
        self._kv_failed.discard(req_id)
        keep, transfer_params = self._connector_finished(request)
        if keep:
            self._kept_blocks[req_id] = request  # freed once the connector reports it sent
        else:
            self.kv.free(request)
        del self.requests[request.request_id]
        self.encoder.release(request.request_id)
        self._constrained.pop(request.request_id, None)
        self.draft_backoff.forget(request.request_id)
        request.grammar = None
        slot = self._lora_slots.pop(request.request_id, None)
        if slot is not None and self.lora is not None:
            self.lora.slots.release(slot)
        self._finished_ids.add(request.request_id)
        return transfer_params

    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """The connector's ``request_finished``: keep the blocks?, and the params for the answer."""
        if self.kv_connector is None:
            return False, None
        answer = self.kv_connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        if isinstance(answer, tuple):
            keep, transfer_params = answer
            return bool(keep), transfer_params
        return bool(answer), None

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_kept_blocks(self) -> bool:
        """Finished requests whose blocks the KV connector keeps (until sent, or a lease ends):
        steps must go on, idle or not, for its worker half to report them."""
        return bool(self._kept_blocks)

    # -- scheduling -----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._admit_compiled_grammars()
        if self.waiting_for_lora:
            self._admit_ready_adapters()
        plan = _StepPlan(self.config.max_num_batched_tokens, [], [], {}, max_requests=self._step_request_cap())
        self.encoder.begin_step()
        self._schedule_running(plan)
        if not self._preempted_ids:
            self._schedule_waiting(plan)
        encoder_inputs, freed_encoder_hashes = self.encoder.end_step()
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new,
            scheduled_cached_reqs=plan.cached,
            num_scheduled_tokens=plan.tokens,
            total_num_scheduled_tokens=sum(plan.tokens.values()),
            finished_req_ids=self._finished_ids,
            preempted_req_ids=self._preempted_ids,
            scheduled_spec_decode_tokens=plan.drafts,
            no_draft_req_ids=self._no_draft_requests(plan),
            lora_loads=self.lora.slots.take_loads() if self.lora is not None else {},
            scheduled_encoder_inputs=encoder_inputs,
            free_encoder_hashes=freed_encoder_hashes,
        )
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(
                self._scheduled_kv_requests(plan), set(self._finished_ids), set(self._preempted_ids))
        self._finished_ids, self._preempted_ids = set(), set()
        if self.config.steps_in_flight > 1:
            self._in_flight.update(plan.tokens)
        return output

    def _step_request_cap(self) -> int:
        """Most requests one step takes: with steps in flight, an even share of the running and
        waiting requests, so that the micro-batches split them (else no cap: 0)."""
        depth = self.config.steps_in_flight
        if depth == 1:
            return 0
        return max(1, -(-(len(self.running) + len(self.waiting)) // depth))

    def _drafting_is_off(self) -> bool:
        """``disable_by_batch_size``: more requests run than drafting pays for."""
        limit = self.config.spec_disable_by_batch_size
        return limit > 0 and len(self.running) > limit

    def _no_draft_requests(self, plan: _StepPlan) -> set[str]:
        """The step's requests whose drafts this step's proposals would be dropped (a large batch,
        or the request paused by the off-switch once this step's token is in): the workers do not
        propose for them, which saves the proposer's work (a draft model's steps)."""
        if not self.config.num_speculative_tokens or not plan.tokens:
            return set()
        if self._drafting_is_off():
            self.num_steps_drafting_off += 1
            return set(plan.tokens)
        backoff = self.draft_backoff
        return {req_id for req_id in plan.tokens
                if backoff.is_paused(req_id, self.requests[req_id].num_output_tokens + 1)}

    def _admit_compiled_grammars(self) -> None:
        """Move requests whose grammar is compiled to the waiting queue (a failed compile ends the request)."""
        manager = self.structured_output
        assert manager is not None
        for request in [r for r in self.waiting_for_grammar.values() if manager.is_ready(r)]:
            del self.waiting_for_grammar[request.request_id]
            try:
                manager.start(request)
            except Exception as exc:  # the request fails, the engine goes on
                logger.warning("request %s: structured output grammar failed to compile: %s", request.request_id, exc)
                self._fail(request, f"the structured output grammar failed to compile: {exc}")
                continue
            request.transition(RequestStatus.WAITING)
            self._constrained[request.request_id] = request
            self.waiting.add(request)

    def _admit_ready_adapters(self) -> None:
        """Move requests whose adapter is loaded and has a device slot to the waiting queue, in
        arrival order (a load that failed ends the request); the others keep waiting."""
        lora = self.lora
        assert lora is not None
        for request in list(self.waiting_for_lora.values()):
            name = request.lora_name
            assert name is not None
            adapter = lora.ready(name)
            if adapter is None:
                continue
            if isinstance(adapter, Exception):
                del self.waiting_for_lora[request.request_id]
                self._fail(request, str(adapter))
                continue
            slot = lora.slots.acquire(adapter)
            if slot is None:
                continue
            del self.waiting_for_lora[request.request_id]
            self._lora_slots[request.request_id] = slot
            request.lora_content_hash = adapter.content_hash
            request.transition(RequestStatus.WAITING)
            self.waiting.add(request)

    def _fail(self, request: Request, error: str) -> None:
        """End a request that is in no queue with an error, reported by the next ``update_from_output``."""
        request.error = error
        request.transition(RequestStatus.FINISHED_ERROR)
        self._release(request)
        self._pending_outputs.append(EngineCoreOutput(
            req_id=request.request_id, new_token_ids=[], finish_status=RequestStatus.FINISHED_ERROR, error=error))

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """Bitmask rows for the constrained requests that reach their last token, and so sample, in
        the step ``scheduler_output`` scheduled; None when none is constrained. Called between
        ``schedule()`` and ``update_from_output()``, while the step's forward runs."""
        if not self._constrained:
            return None
        tokens = scheduler_output.num_scheduled_tokens
        sampling = [r for r in self._constrained.values()
                    if r.request_id in tokens and r.num_computed_tokens + tokens[r.request_id] >= r.num_tokens]
        assert self.structured_output is not None
        return self.structured_output.grammar_bitmask(sampling, scheduler_output.scheduled_spec_decode_tokens)

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            if self._in_flight and request.request_id in self._in_flight:  # its last step is not back yet
                index += 1
                continue
            if plan.max_requests and len(plan.tokens) >= plan.max_requests:
                break
            num_unsent = request.num_tokens - request.num_computed_tokens
            num_new = min(num_unsent + len(request.spec_token_ids), plan.budget)  # drafts count in the budget
            if request.mm_inputs:
                num_new = self.encoder.fit_chunk(request.request_id, request.mm_inputs, request.num_computed_tokens,
                                                 num_new)
                if num_new == 0:  # its next image waits for a step with encoder budget left
                    index += 1
                    continue
            new_blocks = self._allocate_or_preempt(request, num_new, plan)
            if new_blocks is None:  # the request itself was preempted
                continue
            block_ids = new_blocks.get_block_ids()
            num_kept = len(self.kv.get_block_ids(request.request_id)) - len(block_ids)
            plan.cached.append(CachedRequestData(request.request_id, False, block_ids,
                                                 request.num_computed_tokens, _unsent_tokens(request),
                                                 num_kept_blocks=num_kept))
            plan.tokens[request.request_id] = num_new
            plan.budget -= num_new
            if num_new > num_unsent:
                plan.drafts[request.request_id] = request.spec_token_ids[: num_new - num_unsent]
            index += 1

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan) -> KVCacheBlocks | None:
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            # a request in flight is no victim: its step's output is on the way (``request`` is not)
            candidates = ([r for r in self.running if r.request_id not in self._in_flight] if self._in_flight
                          else self.running)
            victim = max(candidates, key=self._victim_key)
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self.running.remove(request)
        self.encoder.withdraw(request.request_id)
        if request.request_id in plan.tokens:  # already scheduled this step: take it back
            plan.budget += plan.tokens.pop(request.request_id)
            plan.drafts.pop(request.request_id, None)
            plan.cached = [c for c in plan.cached if c.req_id != request.request_id]
        self.kv.free(request)
        request.transition(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(request)
        self._preempted_ids.add(request.request_id)
        logger.debug("preempted %s (KV cache full)", request.request_id)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while (self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs
               and not (plan.max_requests and len(plan.tokens) >= plan.max_requests)):
            request = self.waiting.peek()
            loaded = request.request_id in self._kv_loaded  # holds its blocks, loaded KV counted as computed
            if loaded:
                computed_blocks, num_computed = KVCacheBlocks.empty(), request.num_computed_tokens
            else:
                computed_blocks, num_computed = self.kv.get_computed_blocks(request)
                if self._start_kv_load(request, computed_blocks, num_computed):
                    continue
            num_new = request.num_tokens - num_computed
            if num_new > plan.budget and (not self.config.enable_chunked_prefill or self.config.non_causal_prefill):
                break
            num_new = min(num_new, plan.budget)
            if request.mm_inputs:
                num_new = self.encoder.fit_chunk(request.request_id, request.mm_inputs, num_computed, num_new)
                if num_new == 0 or (num_computed + num_new < request.num_tokens
                                    and not self.config.enable_chunked_prefill):
                    self.encoder.withdraw(request.request_id)
                    break  # its next image waits for a step with encoder budget left
            if self.kv.allocate_slots(request, num_new, computed_blocks, 0 if loaded else num_computed) is None:
                self.encoder.withdraw(request.request_id)
                break
            self._kv_loaded.discard(request.request_id)
            self.waiting.pop()
            self._admit(request, num_computed, num_new, plan)

    # -- KV connector ---------------------------------------------------------
    def _start_kv_load(self, request: Request, computed_blocks: KVCacheBlocks, num_computed: int) -> bool:
        """Park ``request`` in ``WAITING_FOR_REMOTE_KVS`` with blocks for the prompt tokens the
        connector can load beyond the local hit ``num_computed``; False (nothing done) if none."""
        connector = self.kv_connector
        if (connector is None or request.status != RequestStatus.WAITING or request.needs_every_position
                or request.request_id in self._kv_failed):
            return False
        update_block_hashes(request, self.kv.block_size)
        num_external = connector.get_num_new_matched_tokens(request, num_computed)
        most = (request.num_tokens - 1) // self.kv.block_size * self.kv.block_size - num_computed
        if num_external <= 0 or num_external % self.kv.block_size or num_external > most:
            if num_external:
                logger.warning("KV connector offered %d tokens of request %s (at most %d, whole blocks): ignored",
                               num_external, request.request_id, most)
            return False
        if self.kv.allocate_slots(request, num_external, computed_blocks, num_computed) is None:
            return False
        request.num_computed_tokens = num_computed
        self.waiting.pop()
        request.transition(RequestStatus.WAITING_FOR_REMOTE_KVS)
        self.waiting_for_remote_kvs[request.request_id] = request
        self._kv_loading[request.request_id] = num_computed + num_external
        connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_external)
        return True

    def _scheduled_kv_requests(self, plan: _StepPlan) -> list[ScheduledKVRequest]:
        """The step's requests for ``build_connector_meta``, their block hashes brought up to date."""
        scheduled = []
        for req_id, num_tokens in plan.tokens.items():
            request = self.requests[req_id]
            update_block_hashes(request, self.kv.block_size)
            num_new = num_tokens - len(plan.drafts.get(req_id, ()))  # a draft's KV may be rejected
            scheduled.append(ScheduledKVRequest(request, self.kv.get_block_ids(request.request_id), request.num_computed_tokens,
                                                num_new))
        return scheduled

    def _apply_kv_connector_output(self, output: KVConnectorOutput) -> None:
        """Loads that completed join the waiting queue with their KV computed; failed ones
        give their blocks back and compute the prompt; sent requests' kept blocks are freed."""
        for req_id in sorted(output.finished_recving | output.failed_recving):
            request = self.waiting_for_remote_kvs.pop(req_id, None)
            if request is None:  # aborted meanwhile
                continue
            num_loaded = self._kv_loading.pop(req_id)
            if req_id in output.failed_recving:
                logger.warning("request %s: its KV could not be loaded; computing its prompt", req_id)
                self.kv.free(request)
                request.num_computed_tokens = 0
                self._kv_failed.add(req_id)
            else:
                self.num_external_hit_tokens += num_loaded - request.num_computed_tokens
                request.num_computed_tokens = num_loaded
                self.kv.cache_blocks(request, num_loaded)
                self._kv_loaded.add(req_id)
            request.transition(RequestStatus.WAITING)
            self.waiting.add_front(request)
        for req_id in sorted(output.finished_sending):
            kept = self._kept_blocks.pop(req_id, None)
            if kept is not None:
                self.kv.free(kept)

    def _admit(self, request: Request, num_computed: int, num_new: int, plan: _StepPlan) -> None:
        resumed = request.status == RequestStatus.PREEMPTED
        request.transition(RequestStatus.RUNNING)
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        self.running.append(request)
        block_ids = self.kv.get_block_ids(request.request_id)
        if resumed:
            plan.cached.append(CachedRequestData(request.request_id, True, block_ids, num_computed,
                                                 _unsent_tokens(request)))
        else:
            plan.new.append(NewRequestData(
                request.request_id, request.prompt_token_ids, request.sampling_params, block_ids,
                num_computed, request.eos_token_id, request.pooling,
                lora_slot=self._lora_slots.get(request.request_id, -1), mm_inputs=request.mm_inputs,
            ))
        plan.tokens[request.request_id] = num_new
        plan.budget -= num_new

    # -- after the model ran ----------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                           ) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._in_flight:
            self._in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        self.encoder_cache_queries += runner_output.encoder_cache_queries
        self.encoder_cache_hits += runner_output.encoder_cache_hits
        if runner_output.kv_connector_output is not None:
            self._apply_kv_connector_output(runner_output.kv_connector_output)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished:  # finished from outside meanwhile
                continue
            request.num_computed_tokens += num_tokens
            if request.mm_inputs:  # the items it has computed past need their encoder output no more
                self.encoder.release(req_id, [i for i in request.mm_inputs if i.end <= request.num_computed_tokens])
            sampled = runner_output.sampled.get(req_id, [])
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled:  # the rejected drafts' KV is not the request's: recompute from there
                request.num_computed_tokens -= num_rejected(drafts, sampled)
                self.spec_decode.record(len(drafts), len(sampled) - 1)
                self.draft_backoff.record(req_id, len(drafts), len(sampled) - 1,
                                          request.num_output_tokens + len(sampled))
            pooled = runner_output.pooled.get(req_id)
            num_before = request.num_output_tokens
            worker_error = runner_output.errors.get(req_id)
            status: RequestStatus | None
            if worker_error is not None:  # this row alone could not be sampled: the request fails, the batch goes on
                request.error = worker_error
                request.transition(status := RequestStatus.FINISHED_ERROR)
            else:
                status = self._append_and_check(request, sampled)
            new_tokens = request.output_token_ids[num_before:]  # a rejected token is not part of the output
            new_logprobs = runner_output.logprobs.get(req_id)
            if pooled is not None:
                request.transition(status := RequestStatus.FINISHED_STOPPED)
            elif status is None and request.is_prompt_only and request.num_computed_tokens >= request.num_tokens:
                # max_tokens 0: the prompt is computed (and scored); its length was all it may have
                request.transition(status := RequestStatus.FINISHED_LENGTH)
            if worker_error is None:  # a failed row's KV may be as broken as its logits: never share it
                self.kv.cache_blocks(request, request.num_computed_tokens)
            outputs.append(EngineCoreOutput(
                req_id=req_id,
                new_token_ids=new_tokens,
                new_logprobs=new_logprobs[: len(new_tokens)] if new_logprobs is not None else None,
                new_prompt_logprobs=runner_output.prompt_logprobs.get(req_id),
                finish_status=status,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                error=request.error,
                pooled=pooled,
            ))
            if status is not None:
                self.running.remove(request)
                outputs[-1].kv_transfer_params = self._release(request)
            elif self.config.num_speculative_tokens:
                if drafts and sampled:  # the rejected drafts' slots go back to the pool now
                    self.kv.free_excess(request, request.num_tokens)
                proposed = (runner_output.spec_token_ids.get(req_id, [])
                            if self.draft_backoff.allows(req_id, request.num_output_tokens)
                            and not self._drafting_is_off() else [])
                request.spec_token_ids = usable_drafts(
                    request, proposed[: self.config.num_speculative_tokens], self.config.max_model_len)
        return outputs

    def _append_and_check(self, request: Request, new_tokens: list[int]) -> RequestStatus | None:
        for token in new_tokens:
            if request.grammar is not None and not request.grammar.accept_tokens([token]):
                # Only a sampler that ignored the bitmask gets here (e.g. every allowed token
                # biased to -inf): fail this request, not the step.
                request.error = (f"structured output: the sampled token {token} is not allowed by the grammar "
                                 "(min_tokens or logit_bias may have masked every token it allows)")
                request.transition(RequestStatus.FINISHED_ERROR)
                return RequestStatus.FINISHED_ERROR
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is None and request.grammar is not None and request.grammar.is_terminated():
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete, ignore_eos or not
            if status is not None:
                request.transition(status)
                return status
        return None

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token in (params.stop_token_ids or ()):
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_stats(self) -> SchedulerSnapshot:
        """The queues and the KV cache now: what the engine core returns with a step's outputs."""
        prefix = self.kv.prefix_cache_stats
        lora = self.lora.snapshot() if self.lora is not None else {}
        return SchedulerSnapshot(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_grammar=len(self.waiting_for_grammar),
            kv_cache_usage=self.kv.usage,
            kv_blocks_free=self.kv.num_free_blocks,
            kv_blocks_total=self.kv.num_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            spec_decode_num_drafts=self.spec_decode.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(self.spec_decode.accepted_per_position),
            spec_decode_num_paused_requests=self.draft_backoff.num_pauses,
            spec_decode_num_paused_steps=self.draft_backoff.num_paused_steps,
            spec_decode_num_steps_drafting_off=self.num_steps_drafting_off,
            num_waiting_for_lora=len(self.waiting_for_lora),
            encoder_cache_queries=self.encoder_cache_queries,
            encoder_cache_hits=self.encoder_cache_hits,
            encoder_input_tokens=self.encoder.num_encoder_input_tokens,
            encoder_budget_deferrals=self.encoder.num_deferrals,
            num_waiting_for_remote_kvs=len(self.waiting_for_remote_kvs),
            prefix_cache_external_hits=self.num_external_hit_tokens,
            **lora,
        )


def _unsent_tokens(request: Request) -> list[int]:
    """The tokens from ``max(prompt, computed)`` on: in a decode step, the one sampled last step.
    Ranks that do not sample learn the sampled tokens from these (``CachedRequestData``)."""
    return request.output_token_ids[max(0, request.num_computed_tokens - request.num_prompt_tokens):]
