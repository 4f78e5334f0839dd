"""The KV connector contract: a scheduler side and a worker side.

The two halves of one connector meet only through what the core carries between them:
the metadata the scheduler side builds each step (``SchedulerOutput.kv_connector_metadata``,
handed to every worker) and the :class:`KVConnectorOutput` the worker side reports back with
the step's ``ModelRunnerOutput``. They may live in different processes.

One step, as the core drives it:

scheduler (engine process), in ``Scheduler.schedule()``:
  1. a waiting request seen for the first time: after the local prefix-cache lookup,
     ``get_num_new_matched_tokens(request, num_computed)`` says how many more prompt tokens
     can be loaded from outside. If any, the core allocates blocks for them, calls
     ``update_state_after_alloc(request, block_ids, num_external)`` and parks the request in
     ``WAITING_FOR_REMOTE_KVS``, outside the waiting queue: it blocks nobody;
  2. ``build_connector_meta(scheduled, finished_req_ids, preempted_req_ids)``: what the
     workers must load or save this step, for any requests (``scheduled`` lists the ones that
     run this step, with their block tables; a preempted request's blocks are gone, maybe to
     another request this very step).
worker (each worker), in ``ModelRunner.execute_model``:
  3. ``bind_connector_metadata(meta)``, then ``start_load_kv()`` before the forward (also in
     a step that runs no forward): a load into blocks may finish now or later;
  4. in every ``Attention`` layer: ``wait_for_layer_load(layer)`` before the attention and
     ``save_kv_layer(layer, kv_cache, metadata)`` once the layer's KV is written (a transport
     that overlaps layers uses them; one that does not may do nothing there);
  5. after the forward, ``wait_for_save()``: every save this step asked for is written or
     handed to the transport; then ``get_finished(finished_req_ids)`` reports the requests
     whose load completed or failed and whose sends completed.
scheduler, in ``update_from_output``:
  6. a request whose load completed joins the waiting queue with the loaded tokens counted
     as computed (its blocks are published to the prefix cache); one whose load failed has
     its blocks freed and joins it to compute its prompt itself: a failed or late load is
     recomputed, never used;
  7. when a request finishes, ``request_finished(request, block_ids)``: ``True`` keeps its
     blocks (a producer whose consumer has not fetched them yet) until the worker side
     reports the request in ``finished_sending``; the connector must report it in the end
     (after a lease if no consumer comes), or the blocks stay taken. It may answer
     ``(keep, kv_transfer_params)`` instead: those params (a dict) go back with the request's
     last output (``RequestOutput.kv_transfer_params``, the server's response), for the
     router to hand the decode engine.

A request's own ``kv_transfer_params`` (``KVTransferParams.of(request)``; None when it has none)
say what the router wants: ``do_remote_decode`` on a prefill engine, ``do_remote_prefill`` and
where the KV is on a decode engine (``tokenmill.kv_transfer.params``).

A finished, aborted or preempted request is in the next step's ``finished_req_ids`` or
``preempted_req_ids``: a worker side must stop reading and writing its blocks (unless kept)
before that step's ``start_load_kv`` returns, since the core may hand them to another request
in that very step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tokenmill.attention import AttentionMetadata, KVCache
    from tokenmill.config import EngineConfig
    from tokenmill.kv_transfer.config import KVTransferConfig
    from tokenmill.request import Request


@dataclass
class KVConnectorContext:
    """What a connector half is built with: ``cls(context)``.

    ``kv_caches`` (worker side only; empty on the scheduler side) are the worker's paged KV
    tensors, one ``(key, value)`` pair per attention layer, each ``[num_blocks, block_size,
    num_kv_heads, head_size]``; they are filled in before the first step
    (``register_kv_caches``).
    """

    transfer_config: KVTransferConfig
    engine_config: EngineConfig
    block_size: int
    rank: int = 0
    device: Any = None
    dtype: Any = None


@dataclass
class ScheduledKVRequest:
    """A request that runs this step, as the scheduler side sees it in ``build_connector_meta``.

    ``block_ids`` is its whole block table; ``num_computed_tokens`` have KV before the step and
    ``num_new_tokens`` more will after it. ``request.block_hashes`` covers every full block of
    those tokens (the prefix-cache hashes: stable across processes and restarts).
    """

    request: Request
    block_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step: request ids."""

    finished_recving: set[str] = field(default_factory=set)  # loaded: their KV is in their blocks
    failed_recving: set[str] = field(default_factory=set)  # could not be loaded: recompute them
    finished_sending: set[str] = field(default_factory=set)  # their kept blocks may be freed

    def merge(self, other: KVConnectorOutput) -> None:
        self.finished_recving |= other.finished_recving
        self.failed_recving |= other.failed_recving
        self.finished_sending |= other.finished_sending

    @property
    def is_empty(self) -> bool:
        return not (self.finished_recving or self.failed_recving or self.finished_sending)


class KVConnectorScheduler(Protocol):
    """The scheduler half, built once in the engine process."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens after the first ``num_computed_tokens`` (the local prefix-cache hit, a
        multiple of the block size) whose KV can be loaded; 0 for none. A multiple of the block
        size, and at most ``num_tokens - 1 - num_computed_tokens`` (the last prompt token is
        always computed, to sample from). Asked once per request."""
        ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks are allocated: the request's whole table ``block_ids``, whose tokens from
        ``num_computed_tokens`` to ``num_computed_tokens + num_external_tokens`` the worker
        side should load. The next ``build_connector_meta`` should tell it to."""
        ...

    def build_connector_meta(self, scheduled: Sequence[ScheduledKVRequest], finished_req_ids: set[str],
                             preempted_req_ids: set[str]) -> Any:
        """This step's metadata for the worker side (picklable; it crosses processes).
        ``finished_req_ids``: requests finished or aborted since the last step;
        ``preempted_req_ids``: requests preempted since then (their blocks were freed, their
        computed tokens are 0 again)."""
        ...

    def request_finished(self, request: Request, block_ids: list[int]) -> bool | tuple[bool, dict[str, Any] | None]:
        """``request`` finished (or was aborted); True keeps its blocks until the worker side
        reports it in ``finished_sending``. ``(keep, params)``: the same, and ``params`` (or
        None) is the ``kv_transfer_params`` of the request's answer."""
        ...


class KVConnectorWorker(Protocol):
    """The worker half, built once in each worker, after its KV cache exists."""

    def register_kv_caches(self, kv_caches: list[KVCache]) -> None:
        """The worker's KV tensors, per attention layer (again after any reallocation)."""
        ...

    def bind_connector_metadata(self, metadata: Any) -> None:
        """This step's ``build_connector_meta`` result, before ``start_load_kv``."""
        ...

    def start_load_kv(self) -> None:
        """Start (or do) the loads the metadata asks for; before the forward."""
        ...

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Before attention layer ``layer_index`` reads its KV this step."""
        ...

    def save_kv_layer(self, layer_index: int, kv_cache: KVCache, metadata: AttentionMetadata) -> None:
        """Attention layer ``layer_index`` has written this step's KV into ``kv_cache``."""
        ...

    def wait_for_save(self) -> None:
        """After the forward: the saves the metadata asks for are written or handed off."""
        ...

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Loads completed or failed and sends completed since the last call."""
        ...

    def shutdown(self) -> None:
        """Stop any transport threads and sockets."""
        ...
