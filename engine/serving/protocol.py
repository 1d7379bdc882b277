"""The small plain-data interface between the server (asyncio side) and the engine thread.

`server/` never touches MLX arrays and `engine/` never imports FastAPI (docs/ARCHITECTURE.md). Everything
that crosses that line is defined here: sampling parameters, the per-step plan the scheduler hands the runner
(with the requests it starts and ends), what the runner hands back, the one tagged event type a request's
stream carries, the per-step statistics the engine publishes, and `EngineClient`, the one handle the server
holds. No mlx import here, so the scheduler and the server can be tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Literal, Mapping, Protocol, Sequence, Union

FinishReason = Literal["stop", "length", "abort", "error"]


class TokenConstraint(Protocol):
    """Which tokens one request may sample next (structured outputs). The server implements it over a grammar
    engine (server/structured_output.py); the runner only asks for masks and reports accepted tokens, so the
    engine never sees a grammar. Stateful: one per request, never shared between requests."""

    def allowed_mask(self) -> bytes:
        """The tokens allowed next, as a packed bitmask: token i is allowed iff bit (i % 8) of byte i // 8 is
        set (little-endian bit order, the layout of 32-bit little-endian mask words). Never all zero: a finished
        grammar allows the end-of-sequence token."""
        ...

    def accept(self, token_id: int) -> None:
        """The token the sampler chose (always one `allowed_mask` allowed); advance the grammar past it."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI names). Validation happens at the HTTP edge."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None  # same seed -> same tokens, whatever else runs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token's logprob + top-k alternatives
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) are masked until this many tokens were generated
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob + top-k alternatives
    # Structured outputs: the allowed-token mask for every sampled token (stateful, one per request).
    constraint: TokenConstraint | None = field(default=None, compare=False)


# ---- the step plan (scheduler -> runner) -------------------------------------------------------


@dataclass(frozen=True)
class PrefillChunk:
    """Run prompt tokens [start, start + len(token_ids)) of one request."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    is_last: bool  # the chunk that completes the prompt samples the first output token


@dataclass(frozen=True)
class DecodeSlot:
    """Run one decode step of a request: feed its last token at `position`."""

    request_id: str
    token_id: int
    position: int


@dataclass(frozen=True)
class NewRequest:
    """A request the runner meets for the first time in this step (it was admitted since the last one)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    num_cached_tokens: int = 0  # leading prompt tokens restored from the prefix cache (Runner.match_prefix)


@dataclass(frozen=True)
class StepPlan:
    """One step, as vLLM's SchedulerOutput: the tokens to run, plus the requests the runner must set up first
    (`new_requests`) and the ones whose state it must drop (`finished_request_ids`, finished since the last
    plan). The runner learns about every request only through plans, so nothing else keeps a registry."""

    decodes: tuple[DecodeSlot, ...] = ()
    prefill: PrefillChunk | None = None
    new_requests: tuple[NewRequest, ...] = ()
    finished_request_ids: tuple[str, ...] = ()

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decodes)

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.prefill.token_ids) if self.prefill else 0

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to release."""
        return self.num_tokens == 0 and not self.finished_request_ids

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Every request this step touches: decodes in order, then the prefill's."""
        prefill_ids = (self.prefill.request_id,) if self.prefill else ()
        return tuple(slot.request_id for slot in self.decodes) + prefill_ids


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's logprob under the raw (unprocessed) distribution of the row before it."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt positions [start, start + len(entries)) of one request, from one prefill chunk. The
    first prompt token has none (nothing precedes it), so the first chunk's entries start at position 1."""

    request_id: str
    start: int
    entries: tuple[PromptLogprob, ...]


@dataclass(frozen=True)
class StepOutput:
    sampled: tuple[SampledToken, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # only for prefills whose request asked for them
    stage_seconds: dict[str, float] = field(default_factory=dict)  # indexer_score, topk, attention, moe, other
    overlap_events: tuple[str, ...] = ()  # OVERLAP_EVENTS that happened in this step, in order


# What the decode overlap (engine/serving/decode_overlap.py) did in a step: the step queued ahead of this one was
# taken by its plan or undone (device time spent for nothing); this step queued the next, or building it failed.
OVERLAP_EVENTS = ("taken", "undone", "queued", "failed")


class Runner(Protocol):
    """Executes a StepPlan on a model. Owns each request's cache, keyed by request id: `execute` first drops
    the plan's finished requests, then sets up its new ones, then runs its tokens. If running the tokens raises,
    the requests must be left as they were before them: the engine re-runs the step without the request that
    fails it (engine_loop.EngineLoop._isolate_failure)."""

    def match_prefix(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        """Leading prompt tokens the runner holds in its prefix cache and will start this request with when a
        plan brings it as new (0: none). The scheduler asks on the engine thread, while planning the request's
        first step, and starts its first chunk there."""
        ...

    def execute(self, plan: StepPlan) -> StepOutput: ...

    def cache_bytes_at(self, num_tokens: int) -> int:
        """Bytes one sequence's cache holds at `num_tokens` tokens (admission control, docs/ARCHITECTURE.md)."""
        ...

    def memory_snapshot(self) -> dict[str, int]:
        """Bytes by kind: weights, kv_cache, planned_workspace, mlx_active, mlx_peak, mlx_cache."""
        ...


# ---- statistics (engine thread -> subscribers; engine -> scrapes) ---------------------------------------


@dataclass(frozen=True)
class StepStats:
    """One step that ran tokens (or only released requests, undoing a decode step queued ahead), published to
    every subscriber (`EngineClient.subscribe`) on the engine thread right after it. The only per-step record the engine keeps: counters are the subscriber's business."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled_tokens: int  # tokens sampled this step, stop tokens included
    stage_seconds: Mapping[str, float]  # the runner's breakdown (StepOutput.stage_seconds); {} if it failed
    step_seconds: Mapping[str, float]  # schedule, execute, postprocess
    failed: bool = False  # the runner raised: its requests got an Error and nothing was sampled
    # With a prefix cache: prompt tokens of the requests this step started, and how many of them it restored
    # from the cache instead of prefilling (vLLM's prefix_cache_queries / prefix_cache_hits, in tokens).
    num_prefix_cache_queried_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    overlap_events: tuple[str, ...] = ()  # StepOutput.overlap_events

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


StepSink = Callable[[StepStats], None]
"""Receives every StepStats on the engine thread: it must be quick and must not block."""


@dataclass(frozen=True)
class EngineStats:
    """The engine's state now (queues, reservations, memory), read by scrapes and health checks."""

    num_running: int
    num_waiting: int
    num_unprefilled_tokens: int  # prompt tokens of admitted requests that no prefill chunk has run yet
    reserved_cache_bytes: int  # admitted requests' caches at max length (KV usage = this / memory_budget_bytes)
    memory_budget_bytes: int | None
    memory: Mapping[str, int]  # runner.memory_snapshot(), taken on the engine thread after the last step
    is_alive: bool  # the engine thread is running
    is_accepting: bool  # False once shutdown began


# ---- events (engine thread -> one request's async stream) --------------------------------------


@dataclass(frozen=True)
class Token:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Progress:
    """Prefill progress; lets the server send SSE keepalives during a long prefill."""

    num_computed_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # of the prompt, restored from the prefix cache (usage.prompt_tokens_details)


@dataclass(frozen=True)
class Done:
    """The stream's last event. A stop token (EOS or one of `stop_token_ids`) that ended the sequence is not
    sent as a `Token` (it never becomes text) but is counted in `num_generated_tokens`, as OpenAI usage does."""

    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    timings: RequestTimings | None = field(default=None, compare=False)  # for metrics; not part of equality


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request spent its time inside the engine (vLLM's per-request histograms).
    A phase the request never reached is None (e.g. prefill_seconds of a request aborted while waiting)."""

    queue_seconds: float | None  # arrival -> admission
    prefill_seconds: float | None  # admission -> first token
    decode_seconds: float | None  # first token -> finish
    e2e_seconds: float  # arrival -> finish


@dataclass(frozen=True)
class Error:
    message: str
    kind: Literal["internal", "rejected", "overloaded"] = "internal"


Event = Union[Token, Progress, PromptLogprobs, Done, Error]


def is_terminal(event: Event) -> bool:
    """Done and Error end a stream; nothing follows them."""
    return isinstance(event, (Done, Error))


# ---- admission (raised to the server before any event) -----------------------------------------

AdmissionReason = Literal["queue_full", "too_long", "never_fits", "shutting_down"]


class AdmissionError(Exception):
    """A request the engine will not take. Raised synchronously, before any event, so the server can answer
    with an HTTP error instead of a stream: `is_overload` reasons are transient (503 + Retry-After), the
    others are the request's own fault (400)."""

    def __init__(self, reason: AdmissionReason, message: str):
        super().__init__(message)
        self.reason: AdmissionReason = reason
        self.message = message

    @property
    def is_overload(self) -> bool:
        return self.reason in ("queue_full", "shutting_down")


# ---- the server's handle on the engine ---------------------------------------------------------------


class EngineClient(Protocol):
    """What the server holds (tessera.engine.serving.engine_loop.AsyncEngine implements it). Call from the event loop,
    except `shutdown`, which blocks (run it in a thread)."""

    def generate(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> AsyncIterator[Event]:
        """The request's events until Done or Error; AdmissionError (before any event) if it is refused.
        Leaving the iteration early aborts the request."""
        ...

    def abort(self, request_id: str) -> None:
        """End a request now (Done 'abort'); unknown ids are a no-op."""
        ...

    def stats(self) -> EngineStats: ...

    def subscribe(self, sink: StepSink) -> None:
        """Call `sink` with every step's StepStats from now on."""
        ...

    def start(self) -> None: ...

    def on_death(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the engine thread) if the engine dies of an error; by then every open stream
        has ended with an Error, /health reports it (stats().is_alive is False) and new requests are refused."""
        ...

    def shutdown(self, timeout: float) -> None: ...
