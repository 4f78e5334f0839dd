"""Operational routes: ``/health`` (no key needed), ``/version``, ``/engine/stats``."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

import tokenmill
from tokenmill_cli.server.errors import error_response
from tokenmill_cli.server.responses import EngineStats, VersionResponse
from tokenmill_cli.server.state import State

router = APIRouter(tags=["operations"])


@router.get("/health", response_model=None)
async def health(state: State) -> Response:
    """200 while the engine loop runs; 503 once it has died (so an orchestrator restarts us)."""
    if not state.engine.is_running:
        return error_response(503, "the engine loop is not running", code="engine_dead")
    return Response(status_code=200)


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=tokenmill.__version__)


@router.get("/engine/stats")
async def engine_stats(state: State) -> EngineStats:
    """Queue lengths and KV-cache occupancy, read without locking: a snapshot for dashboards
    and tests (each number is read atomically; together they may be a step apart)."""
    core = state.engine.engine.core
    return EngineStats(
        running=len(core.scheduler.running),
        waiting=len(core.scheduler.waiting),
        unfinished=state.engine.engine.output_processor.num_unfinished,
        kv_blocks_free=core.kv_manager.num_free_blocks,
        kv_blocks_total=core.kv_manager.num_blocks,
        client_disconnects=state.client_disconnects,
    )
