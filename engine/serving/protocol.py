"""The small plain-data interface between the server (asyncio side) and the engine thread.

DESIGN.md §1: `server/` never touches MLX arrays and `engine/` never imports FastAPI. Everything that
crosses that line is defined here: sampling parameters, the per-step plan the scheduler hands the
runner, what the runner hands back, and the one tagged event type a request's stream carries.
No mlx import here, so the scheduler and the server can be tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence, Union

FinishReason = Literal["stop", "length", "abort", "error"]


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
class StepPlan:
    decodes: tuple[DecodeSlot, ...] = ()
    prefill: PrefillChunk | None = None

    @property
    def num_tokens(self) -> int:
        prefill_tokens = len(self.prefill.token_ids) if self.prefill else 0
        return len(self.decodes) + prefill_tokens

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0

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
class StepOutput:
    sampled: tuple[SampledToken, ...] = ()
    stage_seconds: dict[str, float] = field(default_factory=dict)  # indexer_score, topk, attention, moe, other


class Runner(Protocol):
    """Executes a StepPlan on a model. Owns each request's cache, keyed by request id."""

    def match_prefix(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        """Leading prompt tokens the runner holds in its prefix cache and will restore when the request is
        added (0: none). Asked right before the request's first step; the first chunk starts there."""
        ...

    def add_request(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> None: ...

    def execute(self, plan: StepPlan) -> StepOutput: ...

    def release(self, request_id: str) -> None: ...

    def cache_bytes_at(self, num_tokens: int) -> int:
        """Bytes one sequence's cache holds at `num_tokens` tokens (admission control, DESIGN.md §4)."""
        ...

    def memory_snapshot(self) -> dict[str, int]:
        """Bytes by kind: weights, kv_cache, planned_workspace, mlx_active, mlx_peak, mlx_cache."""
        ...


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


Event = Union[Token, Progress, Done, Error]


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
