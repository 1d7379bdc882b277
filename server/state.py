"""What the routes share: the served model once loaded, the phase (loading / ready / draining), the live engine
request ids and the metrics. Its own module so the app (which builds it) and the routes (which read it) both
import it and not each other."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from tessera.engine.serving.protocol import EngineStats
from tessera.server.errors import unavailable
from tessera.server.metrics import Metrics
from tessera.server.prepare import RequestLimits, ServedModel
from tessera.server.settings import Settings
from tessera.server.workers import WorkerPool

logger = logging.getLogger("tessera.server")

Phase = Literal["loading", "ready", "draining", "engine_dead"]


class AppState:
    """What the routes share: the served model once loaded, the phase, the live engine request ids, metrics."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.served: ServedModel | None = None
        self.is_draining = False
        self.inflight: set[str] = set()  # engine request ids of unfinished choices (generation.ChoiceRun)
        self.workers = WorkerPool(settings.edge_workers)  # parsing and tokenizing, off the event loop
        self.limits = RequestLimits.from_settings(settings)

    @property
    def phase(self) -> Phase:
        if self.is_draining:
            return "draining"
        if self.served is None:
            return "loading"
        return "ready" if self.served.engine.stats().is_alive else "engine_dead"

    def attach(self, served: ServedModel) -> None:
        """Serve this model; its engine's steps are counted by the app's metrics from now on."""
        if served.metrics is not self.metrics:  # its requests would be counted where /metrics never looks
            raise ValueError("the served model must report to the app's Metrics (create_app(..., metrics=))")
        served.engine.subscribe(self.metrics.observe_step)
        self.served = served

    def engine_stats(self) -> EngineStats | None:
        """The engine's current stats for a scrape; None while loading."""
        return self.served.engine.stats() if self.served is not None else None

    def require_model(self) -> ServedModel:
        """The served model, or 503 while loading or draining (readiness says the same)."""
        if self.is_draining:
            raise unavailable("The server is shutting down and takes no new requests")
        if self.served is None:
            raise unavailable("The model is still loading; retry when /ready returns 200")
        return self.served  # a dead engine refuses the request itself (503): no stats read on every request

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown: refuse new requests, let in-flight ones finish for `timeout_s`, abort the rest.

        Aborted requests end with a 503 (or an in-stream error); we wait briefly for those responses too."""
        self.is_draining = True
        logger.info("draining: %d engine requests in flight, %.1f s to finish", len(self.inflight), timeout_s)
        if self.served is not None:
            # Blocking: waits for the scheduler to empty, then aborts what is left and stops the engine thread.
            await asyncio.to_thread(self.served.engine.shutdown, timeout_s)
        deadline = time.monotonic() + 2.0
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        logger.info("drained; %d responses still being written", len(self.inflight))
