"""Prometheus metrics of a Tessera server (every series is listed in docs/OBSERVABILITY.md).

Each fact is recorded on the side that sees it first, so nothing is sampled or guessed:
- the engine's step statistics: `observe_step` subscribes to the engine (`EngineClient.subscribe`, done by
  `AppState.attach`) and gets every step's `StepStats` — prompt and generated tokens, its size, per-stage
  prefill time. Polling would sample steps instead of counting them.
- the asyncio side, through one `RequestTracker` per engine request: time to first token, inter-token latency,
  the finish reason the client saw and the per-request histograms; `Metrics.rejected` for admission refusals.
- a scrape, through `observe_engine(stats)`: running/waiting, prefill tokens in flight, KV-cache usage and
  memory by kind, read when Prometheus asks, so these gauges are current while a long request runs.

Names follow Prometheus conventions (`tessera_` prefix, base units, `_total` counters) with the semantics and
bucket families of vLLM's well-known metrics; `vllm_aliases=True` re-exports the exactly matching ones under
their `vllm:` names (`_VllmAliases`). Every `Metrics` owns its CollectorRegistry, so apps and tests never collide.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from fastapi import APIRouter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.responses import Response

from tessera.engine.serving.protocol import (
    OVERLAP_EVENTS, Done, EngineStats, Error, Event, Progress, PromptLogprobs, StepStats, Token,
)

if TYPE_CHECKING:
    from tessera.server.settings import Settings

# ---- bucket families -------------------------------------------------------------------------------
# vLLM's boundaries (vllm/v1/metrics/loggers.py) kept as a subset, so a vLLM dashboard's `le` thresholds still
# exist; the long end is extended because a 1M-token prompt can queue and prefill for the better part of an hour.

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 1280.0, 2560.0, 3600.0, 7680.0,
)
# A decode token waits behind at most one prefill chunk, so vLLM's range already covers it.
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 3600.0, 7680.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# One stage of one prefill chunk: milliseconds for a short context, up to minutes for a 16K chunk at 1M.
PREFILL_STAGE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 600.0,
)

_M = TypeVar("_M", Gauge, Counter, Histogram)

FINISH_REASONS = ("stop", "length", "abort", "error")
REJECTION_REASONS = ("queue_full", "too_long", "never_fits", "shutting_down")  # tessera.engine.serving.protocol.AdmissionReason
PREFILL_STAGES = ("indexer_score", "topk", "attention", "moe", "other")  # engine/model/trace.py STAGES

# tessera_ family -> the vllm: names with exactly its meaning (counters by their name without `_total`).
# vLLM exports its per-token latency twice: as inter_token_latency_seconds and, under the older name,
# time_per_output_token_seconds; both are fed the same observations, so both alias our one histogram.
VLLM_ALIASES: Mapping[str, tuple[str, ...]] = {
    "tessera_num_requests_running": ("vllm:num_requests_running",),
    "tessera_num_requests_waiting": ("vllm:num_requests_waiting",),
    "tessera_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc",),
    "tessera_prompt_tokens": ("vllm:prompt_tokens",),
    "tessera_generation_tokens": ("vllm:generation_tokens",),
    "tessera_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "tessera_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "tessera_request_success": ("vllm:request_success",),
    "tessera_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tessera_inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    ),
    "tessera_request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "tessera_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tessera_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "tessera_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "tessera_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "tessera_request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "tessera_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "tessera_request_generation_tokens": ("vllm:request_generation_tokens",),
    "tessera_iteration_tokens": ("vllm:iteration_tokens_total",),  # vLLM's histogram carries `_total`
}


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for per-request token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Metrics:
    """All of a server's Prometheus series, on its own registry, and the hooks that move them.

    Thread-safe (prometheus_client metrics lock internally): hooks arrive from the engine thread (`observe_step`),
    the event loop (requests) and the scrape's worker thread (`observe_engine`).
    """

    def __init__(
        self,
        model_name: str,
        settings_info: Mapping[str, object] | None = None,
        vllm_aliases: bool = False,
        *,
        memory_budget_bytes: int | None = None,
        max_model_len: int = 1_048_576,
    ) -> None:
        self.model_name = model_name
        self.memory_budget_bytes = memory_budget_bytes  # the whole budget, shown as memory_bytes{kind="budget"}
        self.registry = CollectorRegistry()
        self._memory_kinds: set[str] = set()
        self._families: dict[str, Collector] = {}
        self._define_engine_series()
        self._define_request_series(max_model_len)
        self._define_tessera_series()
        if settings_info is not None:
            self._config_info.labels(model_name).info(_info_labels(settings_info))
        if vllm_aliases:
            self.registry.register(_VllmAliases(self._families, VLLM_ALIASES))

    @classmethod
    def from_settings(cls, settings: Settings, model_name: str, max_model_len: int) -> Metrics:
        """The server's Metrics: config info, aliases flag, budget and tiling taken from the effective settings."""
        metrics = cls(
            model_name,
            settings.public_dict(),
            settings.metrics_vllm_aliases,
            memory_budget_bytes=settings.memory_budget,
            max_model_len=max_model_len,
        )
        metrics.set_tiling(settings.prefill_chunk, settings.indexer_tile)
        return metrics

    # ---- series ------------------------------------------------------------------------------------

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return self._keep(Gauge(name, doc, ("model_name", *labels), registry=self.registry))

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return self._keep(Counter(name, doc, ("model_name", *labels), registry=self.registry))

    def _histogram(self, name: str, doc: str, buckets: Sequence[float], *labels: str) -> Histogram:
        return self._keep(Histogram(name, doc, ("model_name", *labels), buckets=buckets, registry=self.registry))

    def _keep(self, metric: _M) -> _M:
        """Remember a metric by its family name (a counter's without `_total`), for the aliases."""
        self._families[metric.describe()[0].name] = metric
        return metric

    def _define_engine_series(self) -> None:
        m = self.model_name
        self._running = self._gauge("tessera_num_requests_running", "Requests admitted: prefilling or decoding.")
        self._waiting = self._gauge("tessera_num_requests_waiting", "Requests queued for admission.")
        self._kv_usage = self._gauge(
            "tessera_kv_cache_usage_perc",
            "Fraction of the KV-cache budget reserved by admitted requests (1 = full: new requests wait).",
        )
        self._prompt_tokens = self._counter("tessera_prompt_tokens_total", "Prompt tokens prefilled.").labels(m)
        self._generation_tokens = self._counter(
            "tessera_generation_tokens_total", "Tokens sampled (stop tokens included)."
        ).labels(m)
        self._prefix_queries = self._counter(
            "tessera_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache (requests started)."
        ).labels(m)
        self._prefix_hits = self._counter(
            "tessera_prefix_cache_hits_total", "Prompt tokens restored from the prefix cache instead of prefilled."
        ).labels(m)
        self._iteration_tokens = self._histogram(
            "tessera_iteration_tokens", "Tokens run per engine step (decodes + prefill chunk).",
            ITERATION_TOKENS_BUCKETS,
        ).labels(m)
        self._overlap = self._counter(
            "tessera_decode_overlap_steps_total", "Decode steps queued ahead of their plan, by what became of them: "
            "queued, taken, undone (the plan differed: device time spent for nothing), failed (building one raised).",
            "event",
        )
        for event in OVERLAP_EVENTS:
            self._overlap.labels(m, event)
        self._running.labels(m).set(0)
        self._waiting.labels(m).set(0)
        self._kv_usage.labels(m).set(0)  # exists from the start: the dashboard's panel has data while loading

    def _define_request_series(self, max_model_len: int) -> None:
        m = self.model_name
        self._success = self._counter(
            "tessera_request_success_total", "Finished requests by finish reason.", "finished_reason"
        )
        for reason in FINISH_REASONS:  # exist at 0 from the start, so rate() works before the first finish
            self._success.labels(m, reason)
        self._client_errors = self._counter(
            "tessera_client_errors_total", "HTTP 4xx responses by status and reason (the OpenAI error code, else "
            "its type).", "status", "reason"
        )
        self._ttft = self._histogram(
            "tessera_time_to_first_token_seconds", "Request arrival to its first token.", TTFT_BUCKETS
        ).labels(m)
        self._itl = self._histogram(
            "tessera_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
            INTER_TOKEN_BUCKETS,
        ).labels(m)
        self._tpot = self._histogram(
            "tessera_request_time_per_output_token_seconds",
            "Per request: decode time / (generated tokens - 1).", INTER_TOKEN_BUCKETS,
        ).labels(m)
        latency = {
            "e2e_request_latency": "Request arrival to finish.",
            "request_queue_time": "Arrival to admission (waiting for a cache reservation).",
            "request_prefill_time": "Admission to the first token.",
            "request_decode_time": "First token to finish.",
            "request_inference_time": "Admission to finish (prefill + decode).",
        }
        self._latency = {
            key: self._histogram(f"tessera_{key}_seconds", doc, REQUEST_LATENCY_BUCKETS).labels(m)
            for key, doc in latency.items()
        }
        token_buckets = build_1_2_5_buckets(max_model_len)
        self._request_prompt_tokens = self._histogram(
            "tessera_request_prompt_tokens", "Prompt tokens per finished request.", token_buckets
        ).labels(m)
        self._request_generation_tokens = self._histogram(
            "tessera_request_generation_tokens", "Generated tokens per finished request.", token_buckets
        ).labels(m)

    def _define_tessera_series(self) -> None:
        m = self.model_name
        self._prefill_chunk = self._gauge("tessera_prefill_chunk_tokens", "Global prefill chunk C (tokens).")
        self._indexer_tile = self._gauge("tessera_indexer_tile_tokens", "Lightning-indexer query tile T (tokens).")
        self._config_info = Info(
            "tessera_config", "The effective server settings (API keys redacted).", ("model_name",),
            registry=self.registry,
        )
        self._memory = self._gauge("tessera_memory_bytes", "Memory by kind; kind=\"budget\" is the limit.", "kind")
        self._prefill_stage = self._histogram(
            "tessera_prefill_stage_seconds", "Time per stage of each step that ran a prefill chunk.",
            PREFILL_STAGE_BUCKETS, "stage",
        )
        self._prefill_in_flight = self._gauge(
            "tessera_prefill_tokens_in_flight", "Prompt tokens of admitted requests not yet prefilled."
        ).labels(m)
        self._rejections = self._counter(
            "tessera_admission_rejections_total", "Requests refused before queueing, by reason.", "reason"
        )
        for reason in REJECTION_REASONS:
            self._rejections.labels(m, reason)
        self._http_errors = self._counter(
            "tessera_http_errors_total",
            "Error responses by HTTP status (500: a server failure); an error sent inside an SSE stream after "
            "its 200 counts with the status it would have had.", "status",
        )
        self._http_errors.labels(m, "500")  # at 0 from the start: alert on rate() > 0

    # ---- asyncio side: one engine request (RequestTracker calls these) -------------------------------

    def track(self, num_prompt_tokens: int) -> RequestTracker:
        """Start timing one engine request; call just before submitting it."""
        return RequestTracker(self, num_prompt_tokens)

    def first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def token(self, inter_token_s: float) -> None:
        """A token after the first: the gap since the previous one."""
        self._itl.observe(inter_token_s)

    def request_finished(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        e2e_s: float,
        queue_s: float | None = None,
        prefill_s: float | None = None,
        decode_s: float | None = None,
    ) -> None:
        """A request ended (finish_reason: stop | length | abort | error). A phase the request never reached,
        or whose split is unknown, is None and is not observed (as in tessera.engine.serving.protocol.RequestTimings)."""
        self._success.labels(self.model_name, finish_reason).inc()
        self._request_prompt_tokens.observe(num_prompt_tokens)
        self._request_generation_tokens.observe(num_generation_tokens)
        self._latency["e2e_request_latency"].observe(e2e_s)
        phases = {"request_queue_time": queue_s, "request_prefill_time": prefill_s, "request_decode_time": decode_s}
        for key, seconds in phases.items():
            if seconds is not None:
                self._latency[key].observe(seconds)
        if prefill_s is not None and decode_s is not None:
            self._latency["request_inference_time"].observe(prefill_s + decode_s)
        if decode_s is not None and num_generation_tokens > 1:
            self._tpot.observe(decode_s / (num_generation_tokens - 1))

    def client_error(self, status: int, reason: str) -> None:
        """An HTTP 4xx answered (server/errors.py report_client_error): reason is the error's code or type."""
        self._client_errors.labels(self.model_name, str(status), reason).inc()

    def http_error(self, status: int) -> None:
        self._http_errors.labels(self.model_name, str(status)).inc()

    def rejected(self, reason: str) -> None:
        """A request refused before it was queued (AdmissionError.reason)."""
        self._rejections.labels(self.model_name, reason).inc()

    # ---- engine thread (the engine calls this for every step once subscribed) --------------------------

    def observe_step(self, step: StepStats) -> None:
        """One step: token counters, its size and, if it ran a prefill chunk, the time per stage. A step whose
        runner failed ran nothing that counts."""
        if step.failed:
            return
        self._prompt_tokens.inc(step.num_prefill_tokens)
        self._generation_tokens.inc(step.num_sampled_tokens)
        self._prefix_queries.inc(step.num_prefix_cache_queried_tokens)
        self._prefix_hits.inc(step.num_prefix_cache_hit_tokens)
        if step.num_tokens:  # a step that only released requests ran none
            self._iteration_tokens.observe(step.num_tokens)
        for event in step.overlap_events:
            self._overlap.labels(self.model_name, event).inc()
        if step.num_prefill_tokens == 0:
            return  # decode-only steps would drown the prefill stage times in tiny ones
        for stage, seconds in step.stage_seconds.items():
            self._prefill_stage.labels(self.model_name, stage).observe(seconds)

    # ---- scrape time -----------------------------------------------------------------------------------

    def observe_engine(self, stats: EngineStats) -> None:
        """Queue gauges, prefill tokens in flight, KV-cache usage and memory from the engine's current stats."""
        self._running.labels(self.model_name).set(stats.num_running)
        self._waiting.labels(self.model_name).set(stats.num_waiting)
        self._prefill_in_flight.set(stats.num_unprefilled_tokens)
        if stats.memory_budget_bytes:
            self._kv_usage.labels(self.model_name).set(stats.reserved_cache_bytes / stats.memory_budget_bytes)
        self.set_memory(stats.memory, self.memory_budget_bytes)

    def set_memory(self, snapshot: Mapping[str, int], budget_bytes: int | None) -> None:
        """memory_bytes{kind}: the runner's snapshot, this process's RSS, and the budget. A kind that is no longer
        reported loses its series rather than keeping a stale value."""
        kinds = {**snapshot, **process_memory()}
        if budget_bytes is not None:
            kinds["budget"] = budget_bytes
        for kind in self._memory_kinds - kinds.keys():
            self._memory.remove(self.model_name, kind)
        for kind, num_bytes in kinds.items():
            self._memory.labels(self.model_name, kind).set(num_bytes)
        self._memory_kinds = set(kinds)

    def set_tiling(self, prefill_chunk: int, indexer_tile: int) -> None:
        self._prefill_chunk.labels(self.model_name).set(prefill_chunk)
        self._indexer_tile.labels(self.model_name).set(indexer_tile)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) in Prometheus's text format 0.0.4, whatever the scraper prefers.

        prometheus_client's OpenMetrics and text-1.0.0 encoders escape ':' in names to '_' (its default
        `escaping=underscores`), which would turn `vllm:num_requests_running` into `vllm_num_requests_running`
        and break every vLLM dashboard; the 0.0.4 encoder keeps names as they are, and every scraper reads it."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


class RequestTracker:
    """One engine request seen from the asyncio side: turns its events into Metrics hooks.

    Create it (`Metrics.track`) just before submitting; feed it every event; if the engine refuses the request
    call `on_rejected`; if the server ends it itself (stop string, client gone) call `on_closed`. Exactly one
    finish is recorded, whichever comes first.
    """

    def __init__(self, metrics: Metrics, num_prompt_tokens: int, clock: Callable[[], float] = time.monotonic):
        self._metrics = metrics
        self._clock = clock
        self.num_prompt_tokens = num_prompt_tokens
        self._arrival = clock()
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self.num_streamed_tokens = 0
        self.is_finished = False

    def on_event(self, event: Event) -> None:
        if isinstance(event, Token):
            self._on_token(self._clock())
        elif isinstance(event, Done):
            self._on_done(event)
        elif isinstance(event, Error):
            self._finish("error", self.num_streamed_tokens)
        elif not isinstance(event, (Progress, PromptLogprobs)):
            raise TypeError(f"not an engine event: {event!r}")

    def on_rejected(self, reason: str) -> None:
        """The engine refused the request before any event (AdmissionError): a rejection, not a finish."""
        if not self.is_finished:
            self.is_finished = True
            self._metrics.rejected(reason)

    def on_closed(self, finish_reason: str) -> None:
        """The server ended the request before its last event: "stop" for a stop string (what the client sees),
        "abort" for a disconnect. No-op after Done/Error. The engine's phase split is unknown here."""
        self._finish(finish_reason, self.num_streamed_tokens)

    def _on_token(self, now: float) -> None:
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.first_token(now - self._arrival)
        else:
            self._metrics.token(now - self._last_token_at)  # type: ignore[operator]  # set with the first
        self._last_token_at = now
        self.num_streamed_tokens += 1

    def _on_done(self, done: Done) -> None:
        # A stop token is generated but never streamed (tessera.engine.serving.protocol.Done): it arrived with Done.
        now = self._clock()
        for _ in range(done.num_generated_tokens - self.num_streamed_tokens):
            self._on_token(now)
        timings = done.timings
        if timings is None:
            self._finish(done.finish_reason, done.num_generated_tokens)
            return
        self._record_finish(
            done.finish_reason, done.num_generated_tokens, timings.e2e_seconds,
            timings.queue_seconds, timings.prefill_seconds, timings.decode_seconds,
        )

    def _finish(self, finish_reason: str, num_generated_tokens: int) -> None:
        now = self._clock()
        decode_s = None if self._first_token_at is None else now - self._first_token_at
        self._record_finish(finish_reason, num_generated_tokens, now - self._arrival, None, None, decode_s)

    def _record_finish(self, finish_reason: str, num_generated_tokens: int, e2e_s: float,
                       queue_s: float | None, prefill_s: float | None, decode_s: float | None) -> None:
        if self.is_finished:
            return
        self.is_finished = True
        self._metrics.request_finished(
            finish_reason, self.num_prompt_tokens, num_generated_tokens, e2e_s, queue_s, prefill_s, decode_s
        )


class _VllmAliases(Collector):
    """Re-exports some of our families under vLLM's names at scrape time.

    A rename of the same samples at collect time, not a second set of metric objects fed twice, so an alias can
    never drift from its source and costs nothing per request or step.
    """

    def __init__(self, families: Mapping[str, Collector], aliases: Mapping[str, Iterable[str]]) -> None:
        self._sources = [(families[name], tuple(new_names)) for name, new_names in aliases.items()]

    def collect(self) -> Iterator[Metric]:
        for source, new_names in self._sources:
            for family in source.collect():
                for new_name in new_names:
                    yield _renamed(family, new_name)


def _renamed(family: Metric, new_name: str) -> Metric:
    """`family` with its name, and every sample name's stem, replaced by `new_name`."""
    renamed = Metric(new_name, family.documentation, family.type, family.unit)
    renamed.samples = [
        sample._replace(name=new_name + sample.name[len(family.name):])
        for sample in family.samples
        if not sample.name.endswith("_created")  # creation timestamps would only duplicate ours
    ]
    return renamed


def _info_labels(settings_info: Mapping[str, object]) -> dict[str, str]:
    """Settings as info-metric labels: strings only, None as "", lists and dicts as JSON."""
    labels = {}
    for key, value in settings_info.items():
        if key == "model_name":
            continue  # every series carries it already
        if key == "model" and isinstance(value, str):
            labels[key] = Path(value).name  # the directory's name only: a scrape must not reveal the filesystem
            continue
        if value is None:
            labels[key] = ""
        elif isinstance(value, bool):
            labels[key] = "true" if value else "false"
        elif isinstance(value, (list, tuple, dict)):
            labels[key] = json.dumps(value, sort_keys=True)
        else:
            labels[key] = str(value)
    return labels


def process_memory() -> dict[str, int]:
    """This process's resident set now (Linux: /proc/self/statm) and at its peak (getrusage, everywhere).

    Without /proc (macOS) the current RSS is left out rather than reported as the peak."""
    memory: dict[str, int] = {}
    try:
        with open("/proc/self/statm") as statm:
            memory["process_rss"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    memory["process_peak_rss"] = peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB
    return memory


def metrics_router(metrics: Metrics, stats: Callable[[], EngineStats | None] | None = None) -> APIRouter:
    """GET /metrics. `stats` returns the engine's current stats (None while the model loads); it is read at every
    scrape so the queue and memory gauges are current."""
    router = APIRouter()

    # A plain `def`: FastAPI runs it in its threadpool, so rendering never blocks the event loop.
    @router.get("/metrics", include_in_schema=False)
    def scrape() -> Response:
        current = stats() if stats is not None else None
        if current is not None:
            metrics.observe_engine(current)
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    return router
