"""API-key check: ``Authorization: Bearer <key>`` on every route but ``/health``, ``/ready``, ``/metrics``
and the API's description (``/openapi.json``, ``/docs``, ``/redoc``) unless ``--api-docs-need-key``;
the Anthropic Messages routes (``/v1/messages...``) take ``x-api-key: <key>`` too, as Anthropic's clients send it,
and answer a wrong key in Anthropic's error shape.

A plain ASGI middleware rather than a FastAPI dependency, so it also guards
``/openapi.json``, ``/docs`` and unknown paths, and never wraps streamed
bodies (``BaseHTTPMiddleware`` would, and would hide client disconnects).
"""

from __future__ import annotations

import secrets

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill_cli.server.errors import error_response
from tokenmill_cli.server.messages_objects import anthropic_error

# probes and Prometheus scrapers come without credentials (as with vLLM, /metrics is open)
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
# what the API is, not what it serves: open by default, as vLLM's, so that schema-driven clients
# (schemathesis, code generators) can read it before they know the key
DOCS_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
ANTHROPIC_PREFIX = "/v1/messages"


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, docs_need_key: bool = False) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = OPEN_PATHS if docs_need_key else OPEN_PATHS | DOCS_PATHS
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if _anthropic(scope):
            response = JSONResponse(anthropic_error(401, "Incorrect or missing API key: send `x-api-key: <key>` "
                                                         "or `Authorization: Bearer <key>`.").model_dump(),
                                    status_code=401)
        else:
            response = error_response(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                      code="invalid_api_key")
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        if _anthropic(scope) and b"x-api-key" in headers:
            return secrets.compare_digest(headers[b"x-api-key"], self._key)
        if b"authorization" in headers:
            return secrets.compare_digest(headers[b"authorization"], self._expected)  # constant time: no timing oracle
        return False


def _anthropic(scope: Scope) -> bool:
    path: str = scope["path"]
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")
