"""The engine's adapters: the registry of names, the host-memory LRU cache, the loading
thread and the device slot table.

A request's adapter is read and checked on a background thread (off the step loop); the
request waits in ``WAITING_FOR_LORA`` meanwhile, and joins the waiting queue once its adapter
is in host memory and a device slot is reserved for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from tokenmill.lora.adapter import LoRAAdapter, LoRAAdapterLoader
from tokenmill.lora.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from tokenmill.lora.request import LoRARequest
from tokenmill.lora.slots import LoRASlotTable

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, loader: LoRAAdapterLoader, max_loras: int, max_cpu_loras: int) -> None:
        self.loader = loader
        self.slots = LoRASlotTable(max_loras)
        self.max_cpu_loras = max_cpu_loras
        self.adapters: dict[str, LoRARequest] = {}  # registered names
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU, most recent last
        self._loading: dict[str, Future[LoRAAdapter]] = {}
        self._failed: dict[str, LoRAAdapterError] = {}
        self._lock = threading.Lock()  # the host cache is filled from the loading threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-lora")
        self.load_seconds: list[float] = []  # each load's duration, for the metrics

    # -- registry (any thread) -------------------------------------------------
    def load_now(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter in the calling thread (raises :class:`LoRAAdapterError`)."""
        start = time.perf_counter()
        adapter = self.loader.load(request)
        self.load_seconds.append(time.perf_counter() - start)
        return adapter

    def add(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Register ``request`` under its name (with its already loaded ``adapter``, if given).
        A name registered with another path is an error: unload it first."""
        known = self.adapters.get(request.lora_name)
        if known is not None and known.lora_path != request.lora_path:
            raise LoRAAdapterError(request.lora_name, f"the name is already loaded from {known.lora_path!r}")
        with self._lock:
            self.adapters[request.lora_name] = request
            self._failed.pop(request.lora_name, None)
            if adapter is not None:
                self._cache(adapter)

    def remove(self, name: str) -> None:
        """Forget an adapter: new requests naming it fail; requests that use it finish with it."""
        with self._lock:
            if name not in self.adapters:
                raise LoRAAdapterNotFoundError(name)
            del self.adapters[name]
            self._host.pop(name, None)
        self.slots.retire(name)

    def get(self, name: str) -> LoRARequest:
        request = self.adapters.get(name)
        if request is None:
            raise LoRAAdapterNotFoundError(name)
        return request

    # -- the step loop ---------------------------------------------------------
    def ready(self, name: str) -> LoRAAdapter | LoRAAdapterError | None:
        """The adapter, its load error, or None while it loads (a load starts if none has)."""
        with self._lock:
            adapter = self._host.get(name)
            if adapter is not None:
                self._host.move_to_end(name)
                return adapter
            if name in self._failed:
                return self._failed[name]
            request = self.adapters.get(name)
            if request is None:
                return LoRAAdapterError(name, "was unloaded before the request could start")
            if name not in self._loading:
                self._loading[name] = self._pool.submit(self._load_in_background, request)
        return None

    def _load_in_background(self, request: LoRARequest) -> LoRAAdapter:
        try:
            adapter = self.load_now(request)
        except LoRAAdapterError as exc:
            with self._lock:
                self._failed[request.lora_name] = exc
                self._loading.pop(request.lora_name, None)
            raise
        with self._lock:
            if self.adapters.get(request.lora_name) == request:  # not unloaded meanwhile
                self._cache(adapter)
            self._loading.pop(request.lora_name, None)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            evicted, _ = self._host.popitem(last=False)
            logger.debug("LoRA adapter %s left the host cache", evicted)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    @property
    def num_cached(self) -> int:
        return len(self._host)

    def snapshot(self) -> dict[str, Any]:
        """The ``SchedulerSnapshot`` fields about adapters."""
        slots = self.slots
        return {
            "lora_adapters_in_slots": slots.num_resident,
            "lora_adapters_in_host": len(self._host),
            "lora_requests": tuple((name, users) for name, users in zip(slots.names, slots.users, strict=True)
                                   if name is not None and not name.startswith("\0")),
            "lora_load_seconds": tuple(self.load_seconds),
        }

    def wait_for_any(self, timeout: float) -> None:
        """Block until some load finishes (or ``timeout``): an engine with nothing else to run."""
        with self._lock:
            pending = list(self._loading.values())
        if pending:
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
