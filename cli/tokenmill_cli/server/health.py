"""Operational routes: ``/health`` and ``/ready`` (no key needed), ``/version``, ``/engine/stats``.

``/health`` is liveness: 503 once the engine loop died, or while it has not
gone round for ``health_stall_timeout`` seconds (a hung step); an idle loop
still goes round every few tens of milliseconds, so only a stuck step ages
the heartbeat. ``/ready`` is readiness: 200 while the model is loaded and
requests are admitted, 503 while draining or once the engine is gone.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

import tokenmill
from tokenmill_cli.server.errors import ERROR_RESPONSES, error_response
from tokenmill_cli.server.responses import EngineStats, ErrorResponse, StatusResponse, VersionResponse
from tokenmill_cli.server.state import State

router = APIRouter(tags=["operations"])

_UNAVAILABLE: dict[int | str, dict[str, Any]] = {503: {"model": ErrorResponse, "description": "the engine loop died or hangs (code "
                                                              "engine_dead / engine_stalled), or the server drains"}}
_KEYED: dict[int | str, dict[str, Any]] = {401: ERROR_RESPONSES[401]}


@router.get("/health", response_model=StatusResponse, responses=_UNAVAILABLE)
async def health(state: State) -> Response:
    """200 while the engine loop runs; 503 once it has died or hangs (so an orchestrator restarts us)."""
    engine = state.engine
    if not engine.is_running:
        return error_response(503, f"the engine loop is not running ({engine.dead_reason})", code="engine_dead")
    stalled = engine.seconds_since_heartbeat()
    if stalled > state.settings.health_stall_timeout:
        return error_response(503, f"the engine loop has not gone round for {stalled:.1f} s "
                                   f"(threshold {state.settings.health_stall_timeout:g} s)", code="engine_stalled")
    return JSONResponse(StatusResponse(status="ok").model_dump())


@router.get("/ready", response_model=StatusResponse, responses=_UNAVAILABLE)
async def ready(state: State) -> Response:
    """200 when the model is loaded and new requests are admitted; 503 while draining or dead."""
    if not state.engine.is_running:
        return error_response(503, "the engine is not running", code="engine_dead")
    if state.lifecycle.draining:
        return error_response(503, "the server is shutting down", code="server_shutting_down")
    return JSONResponse({"status": "ready"})


@router.get("/version", responses=_KEYED)
async def version() -> VersionResponse:
    return VersionResponse(version=tokenmill.__version__)


@router.get("/engine/stats", responses=_KEYED)
async def engine_stats(state: State) -> EngineStats:
    """Queue lengths and KV-cache occupancy, read without locking: the scheduler's snapshot as of
    the engine's last step, and counters of the front end (each read atomically; together they
    may be a step apart)."""
    engine = state.engine
    scheduler = engine.scheduler_stats()
    return EngineStats(
        running=scheduler.num_running,
        waiting=scheduler.num_waiting,
        unfinished=engine.num_unfinished_requests,
        kv_blocks_free=scheduler.kv_blocks_free,
        kv_blocks_total=scheduler.kv_blocks_total,
        client_disconnects=state.client_disconnects,
        in_flight=engine.num_requests,
        queued=engine.admission.num_requests,
        queued_tokens=engine.admission.num_tokens,
        deadlines=engine.num_deadlines,
        seconds_since_heartbeat=engine.seconds_since_heartbeat(),
        draining=state.lifecycle.draining,
    )
