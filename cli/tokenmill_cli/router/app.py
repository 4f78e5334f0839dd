"""The router's FastAPI app: prefill on one server, decode on another, the decode side streamed back.

A prefill that fails (the server is down, answers 5xx, or misses ``prefill_timeout``) is not the
client's problem: the decode server computes the prompt itself. A client that goes away cancels
whichever upstream request is running, and closing that connection aborts it on its server (the
servers abort requests whose client disconnects), so neither side keeps blocks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill_cli.router.backends import Backend, BackendPool

logger = logging.getLogger(__name__)

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499
# Fields a prefill request leaves out: it samples one token, once, and answers at once (a stop string
# would end it outside the engine step, which answers no kv_transfer_params).
_NOT_FOR_PREFILL = ("stream", "stream_options", "n", "min_tokens", "max_completion_tokens", "logprobs",
                    "top_logprobs", "best_of", "stop")
_FORWARDED_HEADERS = ("authorization", "x-request-id")
_STREAMED: dict[int | str, dict[str, Any]] = {200: {"description": "JSON, or with `stream: true` server-sent events (`text/event-stream`), "
                                  "as the decode server answers",
                   "content": {"application/json": {}, "text/event-stream": {}}}}


@dataclass
class RouterSettings:
    prefill_urls: list[str]
    decode_urls: list[str]
    prefill_timeout: float = 30.0  # seconds a prefill may take before decode computes the prompt itself


@dataclass
class RouterState:
    prefill: BackendPool
    decode: BackendPool
    client: httpx.AsyncClient
    settings: RouterSettings
    prefill_failures: int = 0  # prefills that failed or timed out (their prompts were recomputed on decode)


def build_router_app(settings: RouterSettings) -> FastAPI:
    state_holder: dict[str, RouterState] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            state_holder["state"] = RouterState(BackendPool("prefill", settings.prefill_urls),
                                                BackendPool("decode", settings.decode_urls), client, settings)
            yield

    app = FastAPI(title="tokenmill router", lifespan=lifespan)

    def state() -> RouterState:
        return state_holder["state"]

    @app.post("/v1/completions", responses=_STREAMED)
    async def completions(request: Request) -> Response:
        """An OpenAI completion: prefilled on a prefill server, generated on a decode server."""
        return await _route(state(), request, "/v1/completions")

    @app.post("/v1/chat/completions", responses=_STREAMED)
    async def chat_completions(request: Request) -> Response:
        """An OpenAI chat completion: prefilled on a prefill server, generated on a decode server."""
        return await _route(state(), request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The models of a decode server."""
        router = state()
        backend = await router.decode.choose(router.client, _headers(request))
        if backend is None:
            return _error(503, "no decode server is reachable")
        upstream = await router.client.get(f"{backend.url}/v1/models", headers=_headers(request))
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while some decode server answers (prefill servers are optional: decode can compute)."""
        router = state()
        up = {pool.role: sum([await _healthy(router.client, b) for b in pool.backends])
              for pool in (router.prefill, router.decode)}
        return JSONResponse({**up, "prefill_failures": router.prefill_failures}, 200 if up["decode"] else 503)

    return app


async def _healthy(client: httpx.AsyncClient, backend: Backend) -> bool:
    try:
        return (await client.get(f"{backend.url}/health", timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


def _headers(request: Request) -> dict[str, str]:
    return {name: value for name in _FORWARDED_HEADERS if (value := request.headers.get(name))}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "router_error", "code": status}}, status)


async def _route(router: RouterState, request: Request, path: str) -> Response:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the request body is not JSON")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    headers = _headers(request)
    prefilled = await _until_disconnected(request, _prefill(router, path, body, headers))
    if isinstance(prefilled, Response):  # the client left, or the prefill server refused the request
        return prefilled
    # the prefill server's answer says where its KV is (and may say there is none to load); without a
    # prefill, decode computes the prompt at once
    transfer = {"do_remote_prefill": False} if prefilled is None else {"do_remote_prefill": True, **prefilled}
    decode_body = {**body, "kv_transfer_params": transfer}
    backend = await router.decode.choose(router.client, headers)
    if backend is None:
        return _error(503, "no decode server is reachable")
    return await _decode(router, request, backend, path, decode_body, headers)


async def _prefill(router: RouterState, path: str, body: dict[str, Any],
                   headers: dict[str, str]) -> dict[str, Any] | Response | None:
    """The prefill server's ``kv_transfer_params`` (empty where it gives none), None where it
    failed, or its error answer for a request it refuses (4xx): decode would refuse it too."""
    backend = await router.prefill.choose(router.client, headers)
    if backend is None:
        router.prefill_failures += 1
        logger.warning("no prefill server is reachable: decode computes the prompt")
        return None
    prefill_body = {key: value for key, value in body.items() if key not in _NOT_FOR_PREFILL}
    prefill_body.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    backend.in_flight += 1
    try:
        response = await router.client.post(f"{backend.url}{path}", json=prefill_body, headers=headers,
                                             timeout=router.settings.prefill_timeout)
    except httpx.HTTPError as exc:
        router.prefill_failures += 1
        logger.warning("prefill on %s failed (%s): decode computes the prompt", backend.url, type(exc).__name__)
        return None
    finally:
        backend.in_flight -= 1
    if 400 <= response.status_code < 500:
        return Response(response.content, response.status_code, media_type="application/json")
    if response.status_code != 200:
        router.prefill_failures += 1
        logger.warning("prefill on %s answered %d: decode computes the prompt", backend.url, response.status_code)
        return None
    params = response.json().get("kv_transfer_params")
    return params if isinstance(params, dict) else {}


async def _decode(router: RouterState, request: Request, backend: Backend, path: str, body: dict[str, Any],
                  headers: dict[str, str]) -> Response:
    """The decode server's answer, streamed through as it comes."""
    backend.in_flight += 1
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            backend.in_flight -= 1

    upstream_request = router.client.build_request("POST", f"{backend.url}{path}", json=body, headers=headers)
    try:
        sent = await _until_disconnected(request, router.client.send(upstream_request, stream=True))
    except httpx.HTTPError as exc:
        release()
        return _error(502, f"the decode server {backend.url} failed: {type(exc).__name__}")
    if isinstance(sent, Response):
        release()
        return sent
    upstream: httpx.Response = sent

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:  # also when the client went away: closing the connection aborts the request upstream
            await upstream.aclose()
            release()

    media_type = upstream.headers.get("content-type", "application/json")
    return StreamingResponse(relay(), status_code=upstream.status_code, media_type=media_type)


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """``work``'s result, unless the client leaves first: then ``work`` is cancelled (its
    upstream connection closed) and the answer is a 499 nobody reads."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)
