"""What the scheduler hands the workers each step: full data for new
requests, diffs for the ones already in the persistent batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tokenmill.kv_transfer.connector import KVConnectorOutput
    from tokenmill.metrics.stats import SchedulerSnapshot


@dataclass
class NewRequestData:
    """A request the workers have never seen: everything needed to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    pooling: str | None = None
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: the base model); fixed for its life
    mm_inputs: list[Any] = field(default_factory=list)  # its MultiModalItems (images), encoded by the workers


@dataclass
class CachedRequestData:
    """A request the workers know: only what changed since the last step.

    ``resumed_from_preemption`` means its old blocks are gone and
    ``new_block_ids`` is its whole block table. ``new_token_ids`` are the request's
    tokens from position ``max(num_prompt_tokens, num_computed_tokens)`` on: the
    rank that samples has them already; the other ranks append the ones they lack.
    """

    req_id: str
    resumed_from_preemption: bool
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    # The block table's length before ``new_block_ids`` are appended (-1: all it had): shorter
    # where the scheduler gave back blocks that held only rejected draft tokens.
    num_kept_blocks: int = -1


@dataclass
class GrammarBitmask:
    """The tokens each constrained request may sample this step.

    ``bitmask`` is ``[len(rows), ceil(vocab_size / 32)]`` int32, bit-packed
    (bit ``j`` of word ``i`` is token ``32 * i + j``; set = allowed); ``rows``
    maps a request id to its row. Only requests that sample this step have one.
    ``Scheduler.grammar_bitmask`` builds it while the step's forward runs; the
    workers get it with ``sample_tokens``.
    """

    bitmask: torch.Tensor
    rows: dict[str, int]
    # A request verifying drafts: its rows, one per verified position (the drafts, then the token after).
    draft_rows: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Finished since the last step: workers drop every trace of them.
    finished_req_ids: set[str] = field(default_factory=set)
    # Preempted since the last step: workers drop them from the batch but keep
    # their state (token ids, seeded generator) for when they resume.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: the draft tokens each request's step verifies. They are the last
    # ``len(drafts)`` of its ``num_scheduled_tokens``, placed after its last sampled token.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # ... and the requests the workers propose no drafts for after this step: the scheduler would drop
    # them (a request paused by the off-switch, every request of a batch past disable_by_batch_size).
    no_draft_req_ids: set[str] = field(default_factory=set)
    # LoRA adapters (``LoRAAdapter``) to copy into device slots before this step runs, by slot.
    lora_loads: dict[int, Any] = field(default_factory=dict)
    # KV connector: what its worker side loads and saves this step (its scheduler side built it).
    kv_connector_metadata: Any = None
    # Multimodal: the items (indices into a request's ``mm_inputs``) the workers encode this step, by
    # request, and the content hashes they drop from their encoder cache first (the scheduler's
    # mirror evicted them: scheduler/encoder_budget.py).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_hashes: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


TokenLogprobs = list[tuple[int, float, int]]  # (token id, logprob, rank), the chosen token first


@dataclass
class ModelRunnerOutput:
    """What the workers send back for one step."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Rows that could not be sampled (non-finite logits), with the reason: those requests fail alone.
    errors: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: the draft tokens proposed for each request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Multimodal: this step's encoder-cache look-ups (one per item a step's tokens overlapped) and hits.
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    # KV connector: the loads and sends its worker side finished (or failed) since the last step.
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class EngineCoreOutput:
    """One request's progress in one step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[list[tuple[int, float, int]]] | None = None  # per token: (token, logprob, rank)
    new_prompt_logprobs: list[list[tuple[int, float, int]]] | None = None
    finish_status: int | None = None  # a finished RequestStatus
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    pooled: list[float] | None = None  # the embedding of a pooling request
    kv_transfer_params: dict[str, Any] | None = None  # the KV connector's, for a finished request's answer

    @property
    def finished(self) -> bool:
        return self.finish_status is not None


@dataclass
class EngineCoreOutputs:
    """What one engine-core step returns: every scheduled request's progress, and the
    scheduler's stats snapshot after the step."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerSnapshot
    num_scheduled_tokens: int = 0
