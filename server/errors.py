"""One mapping from any failure to OpenAI's error object `{"error": {message, type, param, code}}`.

Every path that reports an error goes through `to_api_error`: the FastAPI exception handlers, the edge
middleware (auth, body size) and the SSE stream once its status line is already sent (sse.py).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.engine.serving.protocol import AdmissionError
from tessera.server.chat_format import ChatFormatError
from tessera.server.schemas import Unsupported
from tessera.server.structured_output import GrammarError

logger = logging.getLogger("tessera.server")

QUEUE_FULL_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 5  # loading, draining or a dead engine: a restart or another replica takes a while


class APIError(Exception):
    """An error with its HTTP status and OpenAI fields; raised anywhere on the server side."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its engine requests were already aborted."""


# ---- the errors the routes raise by name ----------------------------------------------------------


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_length_exceeded(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds the server's limit of {limit} bytes (max_body_bytes)",
                    code="request_too_large")


def overloaded(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="queue_full",
                    headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)})


RETRY_LATER_HEADERS = {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}  # loading, draining, or a dead engine


def unavailable(message: str) -> APIError:
    """Loading or draining: readiness is 503 too, so a load balancer has already stopped sending."""
    return APIError(503, message, type="server_error", code="service_unavailable", headers=RETRY_LATER_HEADERS)


def internal_error(message: str = "The server failed to process this request") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


# ---- the one mapping ------------------------------------------------------------------------------

_ADMISSION = {
    "queue_full": lambda m: overloaded(m),
    "too_long": lambda m: context_length_exceeded(m, param="messages"),
    "never_fits": lambda m: invalid_request(m, param="max_tokens", code="insufficient_memory"),
    "shutting_down": lambda m: unavailable(m),
}


def to_api_error(exc: BaseException, request: Request | None = None) -> APIError:
    """Whatever went wrong -> the APIError to report. Unknown exceptions are one request's internal failure."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (RequestValidationError, ValidationError)):
        return _from_validation(list(exc.errors()))
    if isinstance(exc, Unsupported):
        return invalid_request(exc.message, param=exc.param, code="unsupported_value")
    if isinstance(exc, GrammarError):
        return invalid_request(exc.message, param=exc.param)
    if isinstance(exc, ChatFormatError):
        return invalid_request(str(exc.message), param=exc.param)
    if isinstance(exc, AdmissionError):
        make = _ADMISSION.get(exc.reason, lambda m: invalid_request(m))
        return make(exc.message)
    if isinstance(exc, StarletteHTTPException):
        return _from_http(exc, request)
    if isinstance(exc, ClientDisconnected):  # nobody reads this response; 499 is nginx's "client closed request"
        return APIError(499, "Client closed the request", code="client_closed_request")
    logger.error("internal error while serving a request", exc_info=exc)
    return internal_error()


# Loc segments pydantic adds for union members / validators ('str', 'list[int]', 'TextPart', …); field names
# are snake_case, so they never match.
_TYPE_TAG = re.compile(r"^([a-z]+\[.*\]|str|int|float|bool|none|function-.*|[A-Z]\w*)$")


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    param = ""
    for part in loc:
        if part == "body" and not param:
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _TYPE_TAG.match(str(part)):
            param += f".{part}" if param else str(part)
    return param or None


def _from_validation(errors: list[dict[str, Any]]) -> APIError:
    if not errors:
        return invalid_request("Invalid request")
    # A union reports one error per member; the deepest location is the most specific one.
    first = max(errors, key=lambda error: len(error.get("loc", ())))
    if first.get("type") == "json_invalid":
        return invalid_request(f"Request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    param = _param_of(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return invalid_request(f"Unsupported parameter: '{param}' is not supported by Tessera",
                               param=param, code="unsupported_parameter")
    message = str(first.get("msg", "Invalid value")).removeprefix("Value error, ")
    return invalid_request(f"Invalid value for '{param}': {message}" if param else message, param=param)


def _from_http(exc: StarletteHTTPException, request: Request | None) -> APIError:
    route = f"{request.method} {request.url.path}" if request is not None else "route"
    if exc.status_code == 404:
        return APIError(404, f"{route} not found", code="not_found")
    if exc.status_code == 405:
        return APIError(405, f"Method not allowed: {route}", code="method_not_allowed")
    error_type = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type=error_type, headers=dict(exc.headers or {}))


def report_client_error(error: APIError, route: str, metrics: Any | None) -> None:
    """Every 4xx is logged with its code and param and counted by reason (docs/OBSERVABILITY.md).
    `metrics`: the app's tessera.server.metrics.Metrics (None before an app exists)."""
    if not 400 <= error.status < 500:
        return
    reason = error.code or error.type
    logger.info("%s -> %d %s (param=%s): %s", route, error.status, reason, error.param, error.message)
    if metrics is not None:
        metrics.client_error(error.status, reason)


async def handle_exception(request: Request, exc: Exception) -> JSONResponse:
    error = to_api_error(exc, request)
    state = getattr(request.app.state, "tessera", None)
    report_client_error(error, f"{request.method} {request.url.path}", getattr(state, "metrics", None))
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI can see through `handle_exception`."""
    # Not `Exception`: Starlette sends that handler's response and then re-raises, which closes the connection;
    # app.ServerErrorGuard turns unexpected exceptions into 500s instead.
    for exc_type in (APIError, RequestValidationError, ValidationError, StarletteHTTPException, Unsupported,
                     ChatFormatError, GrammarError, AdmissionError, ClientDisconnected):
        app.add_exception_handler(exc_type, handle_exception)
