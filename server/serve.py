"""`tessera serve`: build the engine, run uvicorn, drain on SIGTERM.

Startup: the HTTP server binds first (a port in use fails fast, before minutes of loading), answers
/health and /metrics at once and /ready with 503 until the model is loaded. Shutdown on SIGTERM or Ctrl-C:
readiness turns 503 and new requests get 503, in-flight requests have `shutdown_timeout_s` to finish, the rest
are aborted, then uvicorn exits. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import time
from pathlib import Path
from types import FrameType

import uvicorn

from tessera.server.app import create_app, default_metrics
from tessera.server.metrics import Metrics
from tessera.server.prepare import ModelInfo, ServedModel, served_model_name
from tessera.server.settings import Settings
from tessera.server.state import AppState

logger = logging.getLogger("tessera.serve")

_UVICORN_GRACE_S = 5  # after our drain, how long uvicorn waits for connections still open


def build_engine(settings: Settings, metrics: Metrics | None = None) -> ServedModel:
    """Load the model (the embedded default when `settings.model` is None) and build its engine, not started.

    `metrics`: the app's, already serving /metrics while this loads; None builds one (`AppState.attach`
    subscribes it to the engine's steps). The engine is imported here, not at the top, so the server can be
    imported and tested without MLX or a model."""
    from tessera.engine.serving.factory import EngineOptions
    from tessera.engine.serving.factory import build_engine as build_engine_core

    name = served_model_name(settings)
    built = build_engine_core(EngineOptions(
        model_dir=Path(settings.model) if settings.model is not None else None,
        prefill_chunk=settings.prefill_chunk,
        indexer_tile=settings.indexer_tile,
        max_context=settings.max_context,
        stage_timing_interval=settings.stage_timing_interval,
        max_num_seqs=settings.max_num_seqs,
        max_queued_requests=settings.max_queued_requests,
        memory_budget=settings.memory_budget,
        memory_fraction=settings.memory_fraction,
        world=settings.world,
        weights_dtype=settings.weights_dtype,
        prefix_cache=settings.prefix_cache,
        prefix_cache_bytes=settings.prefix_cache_bytes,
        decode_overlap=settings.decode_overlap,
    ))
    if metrics is None:
        metrics = Metrics.from_settings(settings, name, built.max_model_len)
    elif metrics.model_name != name:
        raise ValueError(f"metrics are labelled {metrics.model_name!r}, the model is served as {name!r}")
    metrics.memory_budget_bytes = built.memory_budget  # memory_bytes{kind="budget"}: the one admission uses
    info = ModelInfo(name=name, root=str(built.model_dir), max_model_len=built.max_model_len,
                     created=int(time.time()))
    return ServedModel(built.engine, built.tokenizer, info, metrics)


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains the app (AppState.drain) before uvicorn shuts down."""

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_draining = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only flip a flag and hand the work to the event loop.
        if self._is_draining or self._loop is None:
            super().handle_exit(sig, frame)  # second signal: uvicorn's own (immediate) shutdown
            return
        self._is_draining = True
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._state.drain(self._state.settings.shutdown_timeout_s)
        finally:
            self.should_exit = True


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(settings: Settings) -> int:
    """Run the server until it is shut down; the process exit code."""
    configure_logging(settings.log_level)
    logger.info("effective settings: %s", json.dumps(settings.public_dict(), sort_keys=True))
    if settings.world > 1:  # under `mlx.launch` every rank runs this; ranks other than 0 serve no HTTP
        from tessera.engine.parallel.follower import follow_if_launched_follower

        code = follow_if_launched_follower(settings.model, settings.indexer_tile, settings.world)
        if code is not None:
            return code
    return asyncio.run(_serve(settings))


async def _serve(settings: Settings) -> int:
    metrics = default_metrics(settings)  # before loading, so /metrics answers (with the settings) at once
    app = create_app(settings, metrics=metrics)
    state: AppState = app.state.tessera
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=_UVICORN_GRACE_S)
    server = DrainingServer(config, state)
    serving = asyncio.ensure_future(server.serve())
    while not server.started:  # bind first: a taken port fails before the model loads
        if serving.done():
            return 1
        await asyncio.sleep(0.05)
    try:
        served = await asyncio.to_thread(build_engine, settings, metrics)
    except Exception:
        logger.exception("could not load the model; shutting down")
        server.should_exit = True
        await serving
        return 1
    if serving.done():  # told to stop while loading
        return 0
    # Everything loaded so far lives as long as the process: keep it out of the collector's full passes, which
    # would otherwise pause the event loop for a walk over the whole heap (vLLM does the same after start-up).
    gc.collect()
    gc.freeze()
    engine_died = _watch_engine(served, server)
    served.engine.start()
    state.attach(served)
    logger.info("serving %s (max_model_len %d) on http://%s:%d", served.info.name, served.info.max_model_len,
                settings.host, settings.port)
    await serving
    if engine_died.is_set():
        return 1
    if not state.is_draining:  # uvicorn stopped on its own (second signal): still stop the engine thread
        await state.drain(0.0)
    return 0


_DEATH_GRACE_S = 0.5  # after the engine died: time for the failed requests' error responses to go out


def _watch_engine(served: ServedModel, server: uvicorn.Server) -> asyncio.Event:
    """If the engine thread dies, exit non-zero (every client already got an error; /ready and /health say 503
    meanwhile) so the supervisor — systemd, Kubernetes, Docker's restart policy — starts a fresh process."""
    loop = asyncio.get_running_loop()
    died = asyncio.Event()

    async def exit_when_dead() -> None:
        await died.wait()
        logger.critical("the engine thread died (see the traceback above); exiting with status 1 to be restarted")
        await asyncio.sleep(_DEATH_GRACE_S)
        server.should_exit = True

    served.engine.on_death(lambda: loop.call_soon_threadsafe(died.set))
    _watchers.add(asyncio.ensure_future(exit_when_dead()))
    return died


_watchers: set[asyncio.Future] = set()  # a reference keeps the watcher task alive
