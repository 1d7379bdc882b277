"""One request's whole state, as the scheduler sees it: one object, derived numbers are properties. The engine
keeps no other per-request record; the runner's cache and the server's stream are keyed by its id.

Token accounting follows vLLM v1: `num_computed_tokens` counts tokens whose keys/values the runner has
written into the request's cache. A prefill catches it up to the prompt; the chunk that completes the prompt
also samples the first output token, which is not yet in the cache. From then on every decode step feeds the
last token (at position `num_computed_tokens`) and samples the next, so while decoding
`num_computed_tokens == num_tokens - 1`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from tessera.engine.serving.protocol import FinishReason, RequestTimings, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no cache
    RUNNING = "running"  # admitted: holds a cache reservation, prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens restored from the prefix cache (None: not looked up yet)
    status: RequestStatus = RequestStatus.WAITING
    admitted_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    reserved_bytes: int = 0  # cache bytes reserved at admission (at its longest), freed when it finishes
    is_started: bool = False  # a plan has handed it to the runner, so a later plan must release it

    def __post_init__(self) -> None:
        self.prompt_ids = tuple(self.prompt_ids)  # any sequence in; immutable inside
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt; send at least one token")

    # ---- derived numbers ----------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_remaining_prompt_tokens(self) -> int:
        return max(self.num_prompt_tokens - self.num_computed_tokens, 0)

    @property
    def max_num_tokens(self) -> int:
        """Prompt + max_tokens: the longest this sequence can grow (before the model's own length cap)."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_waiting(self) -> bool:
        return self.status is RequestStatus.WAITING

    @property
    def is_running(self) -> bool:
        return self.status is RequestStatus.RUNNING

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def timings(self) -> RequestTimings:
        """Time per phase; call once finished."""
        return RequestTimings(
            queue_seconds=_elapsed(self.arrival_time, self.admitted_time),
            prefill_seconds=_elapsed(self.admitted_time, self.first_token_time),
            decode_seconds=_elapsed(self.first_token_time, self.finish_time),
            e2e_seconds=_elapsed(self.arrival_time, self.finish_time) or 0.0,
        )

    # ---- transitions ------------------------------------------------------------------------

    def admit(self, now: float) -> None:
        self.status = RequestStatus.RUNNING
        self.admitted_time = now

    def append_output(self, token_id: int, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_ids.append(token_id)

    def finish(self, reason: FinishReason, now: float) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = now


def _elapsed(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
