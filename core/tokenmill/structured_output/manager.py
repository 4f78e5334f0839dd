"""The engine's side of structured outputs: one backend, a compile cache, a
thread that compiles off the step loop, and the per-step token bitmask.

Lifecycle of a constrained request (driven by the scheduler):

1. ``validate`` in the submitting thread: an invalid schema, regex or grammar
   is an ``InvalidRequestError`` before the engine ever sees the request.
2. ``submit`` when the scheduler takes the request: compilation starts in the
   pool (or hits the cache) and the request waits in ``WAITING_FOR_GRAMMAR``;
   other requests keep running.
3. ``is_ready`` / ``start``: once compiled, the request gets its matcher and
   joins the waiting queue.
4. ``grammar_bitmask`` each step for the constrained requests that sample
   (a row per verified position for one that verifies draft tokens); the
   scheduler advances each matcher with the tokens sampled.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from tokenmill.structured_output.backend import (
    CompiledGrammar,
    StructuredOutputBackend,
    allocate_bitmask,
)
from tokenmill.structured_output.params import GrammarKey, StructuredOutputsParams

if TYPE_CHECKING:
    from tokenmill.plugins.manager import PluginManager
    from tokenmill.request import Request
    from tokenmill.scheduler.output import GrammarBitmask

logger = logging.getLogger(__name__)

BackendFactory = Callable[[], StructuredOutputBackend]
HOOK = "tokenmill_register_structured_output_backends"


class StructuredOutputManager:
    def __init__(self, backend_factory: BackendFactory, vocab_size: int, max_cached: int = 256,
                 max_workers: int = 1) -> None:
        self.vocab_size = vocab_size
        self._factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._lock = threading.Lock()  # validate runs in callers' threads
        self._max_cached = max_cached
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[GrammarKey, Future[CompiledGrammar]] = OrderedDict()
        self._validated: OrderedDict[GrammarKey, None] = OrderedDict()
        self._pending: dict[str, Future[CompiledGrammar]] = {}

    @classmethod
    def from_plugins(cls, plugins: PluginManager, name: str, tokenizer: Any, vocab_size: int,
                     stop_token_ids: Sequence[int]) -> StructuredOutputManager:
        """The manager for backend ``name``; the backend's module is imported on first use."""
        from tokenmill.plugins.specs import resolve_qualname

        qualname = backend_qualname(plugins, name)
        return cls(lambda: resolve_qualname(qualname)(tokenizer, vocab_size, list(stop_token_ids)), vocab_size)

    @property
    def backend(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend

    # -- any thread --------------------------------------------------------
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``InvalidRequestError`` naming the constraint if the backend cannot serve it."""
        key = params.key()
        if key in self._validated:
            return
        self.backend.validate(params)
        with self._lock:
            self._validated[key] = None
            _trim(self._validated, self._max_cached)

    # -- engine thread -----------------------------------------------------
    def submit(self, request: Request) -> None:
        """Start compiling ``request``'s grammar (or share a cached or in-flight compile)."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = params.key()
        future = self._compiled.get(key)
        if future is None:
            future = self._executor().submit(self.backend.compile, params)
            self._compiled[key] = future
            _trim(self._compiled, self._max_cached)
        else:
            self._compiled.move_to_end(key)
        self._pending[request.request_id] = future

    def is_ready(self, request: Request) -> bool:
        return self._pending[request.request_id].done()

    def start(self, request: Request) -> None:
        """Give a ready request its matcher; re-raises a failed compilation."""
        future = self._pending.pop(request.request_id)
        try:
            compiled = future.result()
        except Exception:
            params = request.sampling_params.structured_outputs
            assert params is not None
            self._compiled.pop(params.key(), None)  # a later request gets a fresh try
            raise
        request.grammar = self.backend.matcher(compiled)

    def discard(self, request_id: str) -> None:
        """Forget a request that ended while its grammar compiled (the compile itself stays cached)."""
        self._pending.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def wait_for_any(self, timeout: float) -> None:
        """Block until some pending grammar is compiled (or ``timeout``): for an engine with nothing
        else to run, so it does not spin while the compile thread works."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, requests: Sequence[Request],
                        drafts: dict[str, list[int]] | None = None) -> GrammarBitmask | None:
        """One bitmask row per request, filled by its matcher; ``None`` for no request.

        A request verifying ``drafts`` gets one row per verified position instead (in
        ``draft_rows``): what the grammar allows after each prefix of its drafts. Its matcher
        advances through them to fill those rows and is rolled back after."""
        from tokenmill.scheduler.output import GrammarBitmask

        if not requests:
            return None
        drafts = drafts or {}
        plain = [r for r in requests if not drafts.get(r.request_id)]
        verifying = [r for r in requests if drafts.get(r.request_id)]
        bitmask = allocate_bitmask(len(plain) + sum(1 + len(drafts[r.request_id]) for r in verifying),
                                   self.vocab_size)
        for row, request in enumerate(plain):
            assert request.grammar is not None
            request.grammar.fill_bitmask(bitmask, row)
        result = GrammarBitmask(bitmask, {r.request_id: row for row, r in enumerate(plain)})
        row = len(plain)
        for request in verifying:
            result.draft_rows[request.request_id] = list(range(row, row + 1 + len(drafts[request.request_id])))
            row = _fill_draft_rows(request, drafts[request.request_id], bitmask, row)
        return result

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="tokenmill-grammar")
        return self._pool


def _fill_draft_rows(request: Request, drafts: list[int], bitmask: Any, row: int) -> int:
    """Fill rows ``row .. row + len(drafts)`` with what the grammar allows before each draft
    and after the last; returns the next free row. Past a draft the grammar refuses or after
    one that completes it (the scheduler cut such drafts already), the rows repeat the last
    one filled: no token sampled there is kept."""
    matcher = request.grammar
    assert matcher is not None
    last = row + len(drafts)
    accepted = 0
    for j, token in enumerate(drafts):
        matcher.fill_bitmask(bitmask, row + j)
        if matcher.accept_tokens([token]):
            accepted += 1
            if not matcher.is_terminated():
                continue
        bitmask[row + j + 1 : last + 1] = bitmask[row + j]
        break
    else:
        matcher.fill_bitmask(bitmask, last)
    matcher.rollback(accepted)
    return last + 1


def backend_qualname(plugins: PluginManager, name: str) -> str:
    """The ``"module:Class"`` registered for structured-output backend ``name``."""
    registered = plugins.collect_named(HOOK)
    if name not in registered:
        raise ValueError(f"unknown structured_outputs_backend {name!r}; installed: {sorted(registered)}")
    return registered[name][1]


def _trim(cache: OrderedDict[Any, Any], limit: int) -> None:
    while len(cache) > limit:
        cache.popitem(last=False)
