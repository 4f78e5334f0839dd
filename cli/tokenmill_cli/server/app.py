"""The FastAPI application: routers, error handlers, the API key, metrics, the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

import tokenmill
from tokenmill_cli.server import (
    chat,
    completions,
    embeddings,
    health,
    lora,
    metrics,
    models,
    responses_api,
    tokenization,
)
from tokenmill_cli.server.auth import APIKeyMiddleware
from tokenmill_cli.server.errors import install_error_handlers
from tokenmill_cli.server.lifecycle import Lifecycle
from tokenmill_cli.server.messages_api import router as messages_router
from tokenmill_cli.server.metrics import ServerMetrics
from tokenmill_cli.server.openapi import install_openapi
from tokenmill_cli.server.pooling_routes import classify_router
from tokenmill_cli.server.pooling_routes import router as pooling_router
from tokenmill_cli.server.response_store import ResponseStore
from tokenmill_cli.server.settings import ServerSettings
from tokenmill_cli.server.state import ServerState

if TYPE_CHECKING:
    from tokenmill.entrypoints.async_llm import AsyncLLM

ROUTERS = (models.router, completions.router, chat.router, responses_api.router, embeddings.router, tokenization.router,
           health.router, messages_router)


def build_app(engine: AsyncLLM, settings: ServerSettings, shutdown_engine: bool = True) -> FastAPI:
    """An app serving ``engine``; with ``shutdown_engine`` the engine stops when the app does.

    The engine gets the server's stat loggers (Prometheus, the log line) here.
    """
    server_metrics = ServerMetrics(settings.default_model_name)
    server_metrics.attach(engine, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server_metrics.close()
        if shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan,
                  description="An OpenAI-compatible API over a tokenmill engine.")
    app.state.server = ServerState(engine, settings, Lifecycle(), server_metrics,
                                   response_store=ResponseStore(settings.max_stored_responses))
    for router in ROUTERS:
        app.include_router(router)
    if engine.model_info.pooler is not None:  # score and rerank: a model that pools (cross-encoder or embeddings)
        app.include_router(pooling_router)
    if engine.model_info.classifies:
        app.include_router(classify_router)
    if settings.enable_metrics:
        app.include_router(metrics.router)
    install_error_handlers(app)
    if settings.allow_runtime_lora:
        app.include_router(lora.router)
    if settings.enable_tokenizer_info_endpoint:
        app.include_router(tokenization.info_router)
    install_openapi(app, app.state.server.vocab_size)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, docs_need_key=settings.api_docs_need_key)
    return app

