"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every client mistake maps to a 4xx naming the parameter at fault; a full
queue is a 429 with ``Retry-After``; only the server's own failures are 5xx
(the engine failing a request or dying: 500; shutting down: 503). The
handlers here are the single place where exceptions become HTTP answers.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import EngineDeadError, InvalidRequestError, QueueFullError
from tokenmill.lora import LoRAAdapterNotFoundError
from tokenmill.outputs import RequestOutput
from tokenmill_cli.server.responses import ErrorInfo, ErrorResponse

_MAX_REPORTED_ERRORS = 3


class APIError(Exception):
    """An HTTP answer other than success, raised anywhere in a handler."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _error_type(status)


def _error_type(status: int) -> str:
    """OpenAI's type names: client errors are ``invalid_request_error``, ours ``server_error``."""
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=_encodable(message), type=type or _error_type(status),
                                         param=None if param is None else _encodable(param), code=code))


def _encodable(text: str) -> str:
    """Messages echo what the client sent; a lone surrogate in it would make the answer itself fail."""
    return text.encode("utf-8", "replace").decode("utf-8")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type: str | None = None) -> JSONResponse:
    body = error_body(status, message, param, code, type)
    return JSONResponse(body.model_dump(), status_code=status)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(InvalidRequestError, _invalid_request)
    app.add_exception_handler(LoRAAdapterNotFoundError, _lora_not_found)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(QueueFullError, _queue_full)
    app.add_exception_handler(UnicodeEncodeError, _unencodable)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.type)


async def _invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequestError)
    return error_response(400, str(exc), exc.param)


async def _lora_not_found(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LoRAAdapterNotFoundError)
    return error_response(404, str(exc), exc.param, code="model_not_found")


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = describe_validation_errors(list(exc.errors()))
    return error_response(400, message, param)


async def _http_exception(_: Request, exc: Exception) -> JSONResponse:
    """Routing's answers (404, 405), keeping their headers: a 405 must say what is ``Allow``-ed."""
    assert isinstance(exc, StarletteHTTPException)
    response = error_response(exc.status_code, str(exc.detail) or HTTPStatus(exc.status_code).phrase)
    response.headers.update(exc.headers or {})
    return response


async def _engine_dead(_: Request, exc: Exception) -> JSONResponse:
    return error_response(500, str(exc), code="engine_dead")


async def _queue_full(request: Request, exc: Exception) -> JSONResponse:
    """Counted where it is refused (``AdmissionQueue.on_reject``), not here: a client that left
    meanwhile never gets this answer, yet its request was refused."""
    assert isinstance(exc, QueueFullError)
    state = request.app.state.server
    response = error_response(429, str(exc), code="queue_full", type="rate_limit_error")
    response.headers["Retry-After"] = str(state.settings.retry_after_s)
    return response


async def _unencodable(request: Request, exc: Exception) -> JSONResponse:
    """JSON may escape a lone surrogate (``"\\ud800"``), even in a field name, which pydantic then
    cannot read: the client's text is at fault, not the server."""
    assert isinstance(exc, UnicodeEncodeError)
    if exc.reason == "surrogates not allowed":
        return error_response(400, "the request holds text that is not valid Unicode (a lone surrogate)")
    return await _unexpected(request, exc)


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after sending this, so uvicorn logs the traceback once.
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message and the top-level request field at fault, from pydantic's errors."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    own = first.get("ctx", {}).get("error")
    if isinstance(own, InvalidRequestError):  # raised by one of our cross-field validators
        return str(own), own.param
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return "the request body must be a JSON object, sent with Content-Type: application/json", None
    parts = [f"{_path(e.get('loc', ()))}: {e.get('msg')}" for e in errors[:_MAX_REPORTED_ERRORS]]
    return "; ".join(parts), str(loc[0])


def _path(loc: tuple[Any, ...] | list[Any]) -> str:
    """``('body', 'messages', 0, 'role')`` -> ``messages[0].role``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


# For the OpenAPI schema: the error answers every inference endpoint may give.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "an invalid parameter, named in `error.param`"},
    401: {"model": ErrorResponse, "description": "a missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "an unknown model"},
    429: {"model": ErrorResponse, "description": "the queue is full (--max-queued-requests/-tokens); see Retry-After"},
    500: {"model": ErrorResponse, "description": "the engine failed the request, or died"},
    503: {"model": ErrorResponse, "description": "the server is shutting down"},
}


def exception_body(exc: BaseException) -> ErrorResponse:
    """The error body for an exception met after a stream has started (its status is already sent)."""
    if isinstance(exc, APIError):
        return error_body(exc.status, exc.message, exc.param, exc.code, exc.type)
    if isinstance(exc, InvalidRequestError):
        return error_body(400, str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        return error_body(500, str(exc), code="engine_dead")
    return error_body(500, f"internal error: {type(exc).__name__}: {exc}")


def output_error(output: RequestOutput) -> APIError | None:
    """The error to answer with for a request the engine ended badly, or None.

    One failed sample fails the whole request (500). ``abort`` reaches a
    client only when the server ended the request (shutdown): a 503 saying
    why. ``timeout`` is no error: the output so far is the answer, and its
    finish_reason says it was cut.
    """
    reasons = {sample.finish_reason for sample in output.outputs}
    if "error" in reasons:
        return APIError(500, f"the engine failed this request: {output.error or 'unknown error'}")
    if "abort" in reasons:
        return APIError(503, output.error or "the request was aborted", code="request_aborted")
    return None


# For the OpenAPI schema: what a route that can stream answers with (``"stream": true``).
def streaming_responses(errors: dict[int | str, dict[str, Any]], events: str) -> dict[int | str, dict[str, Any]]:
    """A route's documented answers when it can stream: ``errors``, and a 200 that is JSON or,
    with ``stream``, server-sent ``events`` (a description of them)."""
    return {**errors, 200: {"description": f"the response; with stream: server-sent events, {events}",
                            "content": {"text/event-stream": {}}}}


# chat and completions: the response's chunks (an error body in-band), then [DONE]
STREAMING_RESPONSES = streaming_responses(ERROR_RESPONSES, "each `data:` a chunk, then `data: [DONE]`")
