"""The engine thread and its asyncio bridge (docs/ARCHITECTURE.md, "Threads").

`EngineLoop` owns the runner (and so MLX) on one thread and runs `step()` = schedule -> execute ->
postprocess until there is no work, then sleeps on a condition variable. Other threads only queue requests,
abort them and read stats; they touch the scheduler under the loop's lock and never touch the runner, so
every `runner.execute` happens on the engine thread. The plan tells the runner which requests to set up and
which to drop, so the loop keeps no registry of its own. After every step that ran tokens the loop publishes
a `StepStats` to its subscribers (the server's metrics are one).

`AsyncEngine` is what the FastAPI side holds (an `EngineClient`): `generate()` yields one request's events
(Token | Progress | Done | Error), carried from the engine thread by `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Callable, Iterable, Sequence

from tessera.engine.serving.protocol import (
    AdmissionError, DecodeSlot, EngineStats, Error, Event, PrefillChunk, Runner, SampledToken, SamplingParams,
    StepOutput, StepPlan, StepSink, StepStats, is_terminal,
)
from tessera.engine.serving.request import Request
from tessera.engine.serving.scheduler import RequestEvent, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

EmitFn = Callable[[str, Event], None]
"""Receives every event, on whichever thread produced it, under the loop's lock: it must not block."""


class EngineLoop:
    """One thread that owns the runner. `submit`, `abort`, `stats`, `subscribe`, `shutdown` may be called from
    any thread."""

    _STOP_GRACE_S = 30.0  # how long shutdown waits for the step in flight after aborting everything
    _IDLE_RETRY_S = 0.01  # guard against spinning if work exists but nothing could be scheduled

    def __init__(
        self,
        runner: Runner,
        config: SchedulerConfig,
        emit: EmitFn,
        *,
        eos_token_ids: Iterable[int] = (),
    ):
        self._runner = runner
        self._scheduler = Scheduler(
            config, runner.cache_bytes_at, eos_token_ids=eos_token_ids, prefix_match=runner.match_prefix
        )
        self._emit = emit
        self._cv = threading.Condition()  # guards the scheduler and everything below
        self._sinks: tuple[StepSink, ...] = ()
        self._memory: dict[str, int] = {}  # the runner's last memory snapshot
        self._is_accepting = True
        self._is_stopping = False
        self._is_dead = False  # the engine thread died of an error: terminal, nothing runs any more
        self._on_death: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None

    # ---- any thread ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
        self._thread.start()

    def on_death(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the dying engine thread) if the loop dies of an error, after its requests failed."""
        self._on_death = callback

    def submit(self, request: Request) -> None:
        """Queue a request; raises AdmissionError (nothing queued) if it is refused."""
        with self._cv:
            if self._is_dead:
                raise AdmissionError("shutting_down", "the engine has stopped after an internal error")
            if not self._is_accepting:
                raise AdmissionError("shutting_down", "the server is shutting down and takes no new requests")
            self._scheduler.add(request)
            self._cv.notify_all()

    def abort(self, request_id: str) -> None:
        """End a request now (Done 'abort'); its runner state is released by the next plan."""
        with self._cv:
            self._dispatch(self._scheduler.abort(request_id))
            self._cv.notify_all()

    def subscribe(self, sink: StepSink) -> None:
        with self._cv:
            self._sinks = (*self._sinks, sink)

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(
                num_running=self._scheduler.num_running,
                num_waiting=self._scheduler.num_waiting,
                num_unprefilled_tokens=self._scheduler.num_unprefilled_tokens,
                reserved_cache_bytes=self._scheduler.num_reserved_bytes,
                memory_budget_bytes=self._scheduler.config.memory_budget_bytes,
                memory=dict(self._memory),
                is_alive=self._thread is not None and self._thread.is_alive() and not self._is_dead,
                is_accepting=self._is_accepting,
            )

    def shutdown(self, timeout: float) -> None:
        """Stop admitting, let in-flight requests finish for up to `timeout` s, abort the rest, stop the thread.

        Blocking; from async code use `await asyncio.to_thread(engine.shutdown, timeout)`."""
        with self._cv:
            self._is_accepting = False
            if self._thread is not None and self._thread.is_alive():
                self._cv.wait_for(lambda: not self._scheduler.has_work, timeout)
            self._dispatch(self._scheduler.abort_all())
            self._is_stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(self._STOP_GRACE_S)
            if self._thread.is_alive():
                logger.warning("engine thread still busy %.0f s after shutdown; leaving it", self._STOP_GRACE_S)

    # ---- engine thread -------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one step: schedule -> execute -> postprocess. False when there was nothing to do."""
        started = time.perf_counter()
        with self._cv:
            plan = self._scheduler.schedule()
        if plan.is_empty:
            return False
        scheduled = time.perf_counter()
        try:
            output = self._runner.execute(plan)
        except Exception as exc:  # find the request(s) that make it fail; everyone else goes on
            logger.exception("step failed for requests %s; retrying them in halves", ", ".join(plan.request_ids))
            output = self._isolate_failure(plan, exc)
            if output is None:
                self._publish(plan, None, {"schedule": scheduled - started,
                                           "execute": time.perf_counter() - scheduled})
                return True
        executed = time.perf_counter()
        with self._cv:
            self._dispatch(self._scheduler.postprocess(plan, output))
            self._cv.notify_all()  # shutdown waits for the scheduler to drain
        seconds = {"schedule": scheduled - started, "execute": executed - scheduled}
        seconds["postprocess"] = time.perf_counter() - executed
        self._publish(plan, output, seconds)
        self._snapshot_memory()
        return True

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step on the calling thread until no work is left (or `max_steps`); for tests and benchmarks that
        drive the engine without its thread. Returns the number of steps run."""
        num_steps = 0
        while (max_steps is None or num_steps < max_steps) and self.step():
            num_steps += 1
        return num_steps

    def _run(self) -> None:
        try:
            self._snapshot_memory()
            while self._wait_for_work():
                try:
                    has_run = self.step()
                except Exception:  # a bug outside the runner: fail everything rather than spin on it
                    logger.exception("engine step failed outside the runner; failing all requests")
                    with self._cv:
                        self._dispatch(self._scheduler.fail(self._scheduler.request_ids, "internal engine error"))
                    has_run = True
                if not has_run:
                    with self._cv:
                        self._cv.wait(self._IDLE_RETRY_S)
            self._release_finished()
        except BaseException:  # noqa: B036 — whatever kills the thread, nobody may be left waiting on it
            logger.critical("the engine thread died; failing every request", exc_info=True)
            self._die()

    def _die(self) -> None:
        """Terminal: refuse new requests, end every request with an Error now, tell the owner."""
        with self._cv:
            self._is_dead = True
            self._is_accepting = False
            self._dispatch(self._scheduler.fail(self._scheduler.request_ids,
                                                "the engine stopped after an internal error"))
            self._cv.notify_all()
        if self._on_death is not None:
            try:
                self._on_death()
            except Exception:
                logger.exception("engine death callback failed")

    def _wait_for_work(self) -> bool:
        """Sleep until there is work or a stop; True to go on stepping."""
        with self._cv:
            self._cv.wait_for(
                lambda: self._is_stopping or self._scheduler.has_work or self._scheduler.has_finished_to_release
            )
            return not self._is_stopping

    def _release_finished(self) -> None:
        """On stop: one last plan that only releases what finished (shutdown aborted everything)."""
        with self._cv:
            plan = self._scheduler.take_finished()
        if plan.is_empty:
            return
        try:
            self._runner.execute(plan)
        except Exception:
            logger.exception("releasing %s failed", ", ".join(plan.finished_request_ids))

    def _isolate_failure(self, plan: StepPlan, exc: Exception) -> StepOutput | None:
        """The step raised: re-run its requests in halves until each failing one runs alone, and fail only those.

        Returns the survivors' merged output (postprocess skips the failed requests: they are gone from the
        scheduler), or None if every request failed. A batch of B costs at most ~2·log2(B) extra runs per
        culprit. Relies on the Runner contract that a raising `execute` leaves the requests' state as before its
        tokens ran (runner.py rolls its caches back); the plan's setup and release already happened, so the
        retries carry tokens only."""
        sampled: list[SampledToken] = []
        culprits: dict[str, Exception] = {}

        def retry(sub: StepPlan, error: Exception) -> None:
            if len(sub.request_ids) == 1:
                culprits[sub.request_ids[0]] = error
                return
            for half in _halves(sub):
                try:
                    sampled.extend(self._runner.execute(half).sampled)
                except Exception as half_error:
                    retry(half, half_error)

        retry(StepPlan(decodes=plan.decodes, prefill=plan.prefill), exc)
        for request_id, error in culprits.items():
            logger.error("request %s fails the step on its own; failing it: %s: %s", request_id,
                         type(error).__name__, error, exc_info=error)
        with self._cv:
            # The client sees a generic message with its request id; the detail (above) stays in the log.
            for request_id in culprits:
                self._dispatch(self._scheduler.fail(
                    [request_id], f"internal error in request {request_id}; the server log has the details"))
            self._cv.notify_all()
        if len(culprits) == len(plan.request_ids):
            self._snapshot_memory()
            return None
        return StepOutput(sampled=tuple(sampled))

    def _prefix_cache_counts(self, plan: StepPlan) -> dict[str, int]:
        if not self._scheduler.config.prefix_cache_bytes:
            return {}
        return {
            "num_prefix_cache_queried_tokens": sum(len(new.prompt_ids) for new in plan.new_requests),
            "num_prefix_cache_hit_tokens": sum(new.num_cached_tokens for new in plan.new_requests),
        }

    def _publish(self, plan: StepPlan, output: StepOutput | None, seconds: dict[str, float]) -> None:
        """Hand the step's statistics to every subscriber (a step that only released requests has none, unless
        it undid a decode step queued ahead: that device time counts)."""
        if plan.num_tokens == 0 and not (output is not None and output.overlap_events):
            return
        stats = StepStats(
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_sampled_tokens=len(output.sampled) if output is not None else 0,
            stage_seconds=dict(output.stage_seconds) if output is not None else {},
            step_seconds=seconds,
            failed=output is None,
            overlap_events=output.overlap_events if output is not None else (),
            **self._prefix_cache_counts(plan),
        )
        for sink in self._sinks:
            try:
                sink(stats)
            except Exception:
                logger.exception("step statistics subscriber %r failed", sink)

    def _snapshot_memory(self) -> None:
        # On the engine thread: the runner's memory queries touch MLX, which only this thread may.
        try:
            memory = dict(self._runner.memory_snapshot())
        except Exception:
            logger.exception("runner.memory_snapshot() failed")
            return
        with self._cv:
            self._memory = memory

    def _dispatch(self, events: list[RequestEvent]) -> None:
        """Send events (caller holds the lock, so a request's events keep their order across threads)."""
        for request, event in events:
            try:
                self._emit(request.request_id, event)
            except Exception:
                logger.exception("event sink failed for %r", request.request_id)


def _halves(plan: StepPlan) -> tuple[StepPlan, StepPlan]:
    """A tokens-only plan split into two with about half its requests each (the prefill goes with the second)."""
    items: list[DecodeSlot | PrefillChunk] = [*plan.decodes, *([plan.prefill] if plan.prefill else [])]
    middle = len(items) // 2

    def plan_of(part: list[DecodeSlot | PrefillChunk]) -> StepPlan:
        prefill = next((item for item in part if isinstance(item, PrefillChunk)), None)
        return StepPlan(decodes=tuple(item for item in part if isinstance(item, DecodeSlot)), prefill=prefill)

    return plan_of(items[:middle]), plan_of(items[middle:])


class RequestStream:
    """One request's events in order, ending with Done or Error. Iterate it on the event loop that made it."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._is_finished = False

    @property
    def is_finished(self) -> bool:
        """True once the terminal event has been taken from the stream."""
        return self._is_finished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._is_finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._is_finished = is_terminal(event)
        return event

    def put_threadsafe(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more


class AsyncEngine:
    """The server's handle on the engine (an `EngineClient`): submit/generate, abort, stats, subscribe, start,
    shutdown."""

    def __init__(self, runner: Runner, config: SchedulerConfig, *, eos_token_ids: Iterable[int] = ()):
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._death_callbacks: list[Callable[[], None]] = []
        self._engine = EngineLoop(runner, config, self._deliver, eos_token_ids=eos_token_ids)
        self._engine.on_death(self._fail_open_streams)

    def start(self) -> None:
        self._engine.start()

    def shutdown(self, timeout: float) -> None:
        """Blocking (see EngineLoop.shutdown): every open stream ends, with Done or Done('abort')."""
        self._engine.shutdown(timeout)

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def subscribe(self, sink: StepSink) -> None:
        """Call `sink` with every step's StepStats, on the engine thread, from now on."""
        self._engine.subscribe(sink)

    def abort(self, request_id: str) -> None:
        """End a request (the client went away). Its cache is released within one step; unknown ids: no-op."""
        self._engine.abort(request_id)

    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> RequestStream:
        """Queue a request and return its stream. Call on the event loop. Raises AdmissionError (or ValueError
        for an empty prompt or a request id in use) at once, before any event."""
        request = Request(request_id, tuple(prompt_ids), sampling)
        stream = RequestStream(request_id)
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        try:
            self._engine.submit(request)
        except BaseException:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncIterator[Event]:
        """Yield the request's events until Done or Error. AdmissionError is raised by the first `__anext__`,
        before any event. Leaving early (break, aclose, cancellation) aborts the request."""
        stream = self.submit(request_id, prompt_ids, sampling)
        try:
            async for event in stream:
                yield event
        finally:
            if not stream.is_finished:
                self.abort(request_id)

    def on_death(self, callback: Callable[[], None]) -> None:
        """Also call `callback` (on the engine thread) once every open stream got its Error, if the engine dies."""
        self._death_callbacks.append(callback)

    def _fail_open_streams(self) -> None:
        # The loop failed what its scheduler held; a stream it never saw (mid-submit) must not wait forever.
        with self._streams_lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put_threadsafe(Error("the engine stopped after an internal error"))
        for callback in self._death_callbacks:
            callback()

    def _deliver(self, request_id: str, event: Event) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
            if stream is not None and is_terminal(event):
                del self._streams[request_id]
        if stream is not None:
            stream.put_threadsafe(event)
