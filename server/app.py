"""The FastAPI application: the edge guard, routes and error handlers around one `AppState` (server/state.py).

`create_app(settings, engine, tokenizer, model_info)` serves an engine built elsewhere (tests pass one over
ScriptedRunner); `create_app(settings)` starts in the loading state and `AppState.attach` makes it ready
once serve.py has built the real engine. Either way GET /metrics answers from the start: the app owns one
`Metrics`, which the served model's requests report to and which `attach` subscribes to the engine's steps.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.engine.model.tokenizer import Tokenizer
from tessera.engine.serving.protocol import EngineClient
from tessera.server.errors import (
    APIError,
    install_error_handlers,
    payload_too_large,
    report_client_error,
    to_api_error,
    unauthorized,
)
from tessera.server.metrics import Metrics, metrics_router
from tessera.server.openapi import PROTECTED_PREFIXES, install_openapi
from tessera.server.prepare import ModelInfo, ServedModel, served_model_name
from tessera.server.routes import router
from tessera.server.settings import Settings
from tessera.server.state import AppState

V4_MAX_CONTEXT = 1_048_576  # DeepSeek-V4's max_position_embeddings: token-count buckets before the model is read


class EdgeGuard:
    """Pure ASGI middleware, before any parsing: API keys on inference routes, then the body-size limit."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int, metrics: Metrics | None = None) -> None:
        self.app = app
        self._key_digests = [_digest(key.encode()) for key in api_keys]
        self._max_body_bytes = max_body_bytes
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            if self._key_digests and scope["path"].startswith(PROTECTED_PREFIXES):
                self._check_key(_header(scope, b"authorization"))
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._buffered_body(scope, receive)
        except APIError as exc:
            report_client_error(exc, f"{scope['method']} {scope['path']}", self._metrics)
            await exc.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check_key(self, authorization: bytes | None) -> None:
        scheme, _, key = (authorization or b"").partition(b" ")
        # Constant time: fixed-length digests (no length leak), every key compared whatever matched already.
        digest = _digest(key.strip())
        matched = False
        for candidate in self._key_digests:
            matched |= hmac.compare_digest(digest, candidate)
        if scheme.lower() != b"bearer" or not matched:
            raise unauthorized()

    async def _buffered_body(self, scope: Scope, receive: Receive) -> Receive:
        """Read the whole body (the app would anyway), refusing it past the limit; replay it to the app."""
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            raise payload_too_large(self._max_body_bytes)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)  # disconnected mid-body: let the app see it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body_bytes:
                raise payload_too_large(self._max_body_bytes)
            if not message.get("more_body", False):
                break
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


class ServerErrorGuard:
    """Outermost ASGI middleware: every response's error status is counted, and an unexpected exception becomes
    an OpenAI-shaped 500 that keeps the connection usable.

    Starlette's own last-resort handler sends the 500 and then re-raises, and uvicorn answers a raise by closing
    the connection — without `Connection: close`, so a keep-alive client's next request on it fails. Here the
    exception ends with the response (logged with its traceback by errors.to_api_error). Only when the response
    had already started is there nothing to send: then it is re-raised and the connection closes."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        has_started = False

        async def counted_send(message: Message) -> None:
            nonlocal has_started
            if message["type"] == "http.response.start":
                has_started = True
                if message["status"] >= 400:
                    self._metrics.http_error(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        except Exception as exc:
            if has_started:
                raise
            await to_api_error(exc).response()(scope, receive, counted_send)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key.lower() == name), None)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that returns `messages` first, then the real ones (so disconnects still arrive)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def create_app(
    settings: Settings,
    engine: EngineClient | None = None,
    tokenizer: Tokenizer | None = None,
    model_info: ModelInfo | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """The app; with an engine (+ tokenizer, model_info) it is ready at once, else it waits for `attach`.

    `metrics`: the Metrics to serve and feed; None builds one from the settings."""
    if metrics is None:
        metrics = default_metrics(settings, model_info)
    state = AppState(settings, metrics)
    if engine is not None:
        if tokenizer is None or model_info is None:
            raise ValueError("create_app needs the tokenizer and model_info with the engine")
        state.attach(ServedModel(engine, tokenizer, model_info, metrics))
    app = FastAPI(title="Tessera", summary="OpenAI-compatible server for DeepSeek-V4 on MLX")
    app.state.tessera = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(metrics_router(metrics, state.engine_stats))
    app.add_middleware(EdgeGuard, api_keys=list(settings.api_keys), max_body_bytes=settings.max_body_bytes,
                       metrics=metrics)
    app.add_middleware(ServerErrorGuard, metrics=metrics)
    if settings.allowed_origins:
        # Added last, so outermost: a preflight OPTIONS is answered here, before EdgeGuard's key check, and
        # every response, errors included (401, 413, 500), carries CORS headers a browser can read. vLLM's
        # defaults.
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    install_openapi(app)
    return app


def default_metrics(settings: Settings, model_info: ModelInfo | None = None) -> Metrics:
    """The server's Metrics, buildable before the model loads: the name comes from the settings; per-request
    token-count buckets reach the model's length if known, else max_context, else V4's 1M."""
    if model_info is not None:
        return Metrics.from_settings(settings, model_info.name, model_info.max_model_len)
    return Metrics.from_settings(settings, served_model_name(settings), settings.max_context or V4_MAX_CONTEXT)
