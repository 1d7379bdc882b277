"""Which tokens run next: admission, one step's plan, and the bookkeeping after it. No mlx import.

Schedule tokens, not phases (vLLM v1): each step runs every running request that is decoding
(one token each) and fills the rest of the token budget with at most one prefill chunk, taken from the oldest
request still prefilling. So a 1M-token prompt delays the others' decoding by at most one chunk per step
(docs/ARCHITECTURE.md). Waiting requests are admitted FIFO while `max_num_seqs` and the memory budget allow; the
head of the queue is never skipped, so a large request cannot starve behind a stream of small ones.

Memory accounting is kept here (a number per request); the cache itself lives in the runner. A request
reserves its cache at its longest possible length when it is admitted and frees it when it finishes.

With a prefix cache (engine/serving/prefix_cache.py) the runner is asked, as a request's first chunk is planned,
how many leading prompt tokens it can restore; the request starts there, and chunks end on the cache's blocks.

The plan also tells the runner which requests it meets for the first time and which finished since the last
plan (vLLM's SchedulerOutput), so the scheduler's `Request` objects are the one record of every request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from tessera.engine.serving.protocol import (
    AdmissionError,
    DecodeSlot,
    Done,
    Error,
    Event,
    FinishReason,
    NewRequest,
    PrefillChunk,
    Progress,
    PromptLogprobs,
    SampledToken,
    StepOutput,
    StepPlan,
    Token,
)
from tessera.engine.serving.prefix_blocks import BLOCK_TOKENS, aligned_chunk_end
from tessera.engine.serving.request import Request, RequestStatus

__all__ = ["AdmissionError", "Scheduler", "SchedulerConfig", "RequestEvent"]

RequestEvent = tuple[Request, Event]
PrefixMatchFn = Callable[[str, tuple[int, ...]], int]  # (request id, prompt) -> leading tokens the runner restores


@dataclass(frozen=True)
class SchedulerConfig:
    prefill_chunk: int = 4096
    """Token budget of one step: all decoding requests (one token each) plus at most one prefill chunk of
    `prefill_chunk - num_decodes` tokens. It bounds the prefill workspace (engine/model/memory_plan.py) and how long a decode
    waits behind a prefill. Raise it for prefill throughput, lower it for smoother decoding."""

    max_num_seqs: int = 16
    """Most requests admitted at once (prefilling or decoding, each holding a cache). Every decoding request
    runs every step, so it must be at most `prefill_chunk`."""

    max_queued_requests: int = 256
    """Most requests waiting for admission; one more gets AdmissionError('queue_full'). A request that can be
    admitted at once never counts against it, so 0 means 'no queue: run now or refuse'."""

    max_model_len: int = 1_048_576
    """Most tokens (prompt + generated) one sequence may reach; a longer prompt is refused ('too_long') and
    generation stops with finish_reason 'length' when a sequence reaches it."""

    memory_budget_bytes: int | None = None
    """Bytes the caches of admitted requests may hold together, each counted at its longest possible length
    (prompt + max_tokens, capped by max_model_len). Weights and workspace are not in it: the caller subtracts
    them. None: admission is limited by `max_num_seqs` alone."""

    prefix_cache_bytes: int = 0
    """Bytes of the prefix cache (engine/serving/prefix_cache.py); 0: off. They come out of the memory budget:
    requests are admitted against `memory_budget_bytes - prefix_cache_bytes`. When on, a prefill chunk ends on
    a block of BLOCK_TOKENS tokens where it can, and at the prompt's last block boundary, so the runner can
    save the prefix there."""

    def __post_init__(self) -> None:
        _require(self.prefill_chunk >= 1, f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_seqs <= self.prefill_chunk,
            f"max_num_seqs ({self.max_num_seqs}) must be <= prefill_chunk ({self.prefill_chunk}): every decoding "
            "request runs every step inside the prefill_chunk token budget; lower max_num_seqs or raise prefill_chunk",
        )
        _require(self.max_queued_requests >= 0, f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        _require(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(
            self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
            f"memory_budget_bytes must be positive or None, got {self.memory_budget_bytes}",
        )
        _require(self.prefix_cache_bytes >= 0, f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        _require(
            self.memory_budget_bytes is None or self.prefix_cache_bytes < self.memory_budget_bytes,
            f"prefix_cache_bytes ({self.prefix_cache_bytes}) must be less than the caches' memory budget "
            f"({self.memory_budget_bytes} bytes): it comes out of that budget; lower prefix_cache_bytes",
        )

    @property
    def request_budget_bytes(self) -> int | None:
        """What the admitted requests' caches may hold: the budget less the prefix cache's share."""
        return None if self.memory_budget_bytes is None else self.memory_budget_bytes - self.prefix_cache_bytes


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class Scheduler:
    """Owns the waiting queue and the running set. Not thread-safe: the engine loop serializes calls."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache_bytes_at: Callable[[int], int],
        *,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        prefix_match: PrefixMatchFn | None = None,
    ):
        self.config = config
        # Asked once per request, when its first chunk is scheduled (on the engine thread, right before the
        # runner meets the request); only with a prefix cache configured.
        self._prefix_match = prefix_match if config.prefix_cache_bytes > 0 else None
        self._cache_bytes_at = cache_bytes_at  # bytes of one sequence's cache at n tokens (Runner.cache_bytes_at)
        self._eos_token_ids = frozenset(eos_token_ids)
        self._clock = clock
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order: the oldest prefill goes first
        self._requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self._finished_ids: list[str] = []  # started requests finished since the last plan: the runner drops them

    # ---- queries ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def has_finished_to_release(self) -> bool:
        """Requests the runner still holds state for although they finished (the next plan releases them)."""
        return bool(self._finished_ids)

    @property
    def num_reserved_bytes(self) -> int:
        return sum(request.reserved_bytes for request in self._running)

    @property
    def num_unprefilled_tokens(self) -> int:
        """Prompt tokens of admitted requests that no prefill chunk has run yet."""
        return sum(request.num_remaining_prompt_tokens for request in self._running)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Every unfinished request, waiting or running."""
        return tuple(self._requests)

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def max_num_tokens(self, request: Request) -> int:
        """The longest this request's sequence can grow: prompt + max_tokens, capped by max_model_len."""
        return min(request.max_num_tokens, self.config.max_model_len)

    # ---- admission ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request, admitting it at once if nothing waits ahead of it and it fits.

        Raises AdmissionError ('too_long', 'never_fits', 'queue_full') before the request is queued."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._check_length(request)
        self._check_memory(request)
        if not self._can_admit_now(request) and self.num_waiting >= self.config.max_queued_requests:
            raise AdmissionError(
                "queue_full",
                f"{self.num_waiting} requests are already waiting (max_queued_requests="
                f"{self.config.max_queued_requests}); retry later",
            )
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._waiting.append(request)
        self._admit_waiting()

    def _check_length(self, request: Request) -> None:
        max_model_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_model_len:
            raise AdmissionError(
                "too_long",
                f"the prompt has {request.num_prompt_tokens} tokens; this server's maximum context length is "
                f"{max_model_len} tokens (max_model_len) and must leave room for at least one generated token. "
                "Shorten the prompt.",
            )

    def _check_memory(self, request: Request) -> None:
        """Refuse a request whose cache alone, at its longest, exceeds the whole budget: waiting cannot help."""
        budget = self.config.request_budget_bytes
        if budget is None:
            return
        num_bytes = self._reservation_bytes(request)
        if num_bytes > budget:
            raise AdmissionError(
                "never_fits",
                f"this request's cache at its maximum length ({self.max_num_tokens(request)} tokens: prompt + "
                f"max_tokens) needs {num_bytes} bytes, more than the whole memory budget ({budget} bytes"
                f"{' after the prefix cache' if self.config.prefix_cache_bytes else ''}). "
                "Lower max_tokens or shorten the prompt.",
            )

    def _reservation_bytes(self, request: Request) -> int:
        return self._cache_bytes_at(self.max_num_tokens(request))

    def _can_admit_now(self, request: Request) -> bool:
        return not self._waiting and self._can_admit(request)

    def _can_admit(self, request: Request) -> bool:
        if self.num_running >= self.config.max_num_seqs:
            return False
        budget = self.config.request_budget_bytes
        if budget is None:
            return True
        return self.num_reserved_bytes + self._reservation_bytes(request) <= budget

    def _admit_waiting(self) -> None:
        """FIFO: admit from the head of the queue while it fits; never skip the head."""
        while self._waiting and self._can_admit(self._waiting[0]):
            request = self._waiting.popleft()
            request.reserved_bytes = self._reservation_bytes(request)
            request.admit(self._clock())
            self._running.append(request)

    # ---- one step's plan -----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step: every decoding request, then at most one prefill chunk in the remaining budget; the
        requests it starts and the ones that finished since the last plan."""
        self._admit_waiting()
        decodes = self._schedule_decodes()
        prefill = self._schedule_prefill(self.config.prefill_chunk - len(decodes))
        plan = StepPlan(decodes=decodes, prefill=prefill)
        return replace(self.take_finished(), decodes=decodes, prefill=prefill, new_requests=self._start(plan.request_ids))

    def take_finished(self) -> StepPlan:
        """A plan that only releases what finished since the last plan (alone: the engine's last act)."""
        finished, self._finished_ids = tuple(self._finished_ids), []
        return StepPlan(finished_request_ids=finished)

    def _start(self, request_ids: Iterable[str]) -> tuple[NewRequest, ...]:
        # A request meets the runner on its first scheduled step, after admission: waiting requests hold no
        # runner state, matching the memory accounting above.
        new = []
        for request_id in request_ids:
            request = self._requests[request_id]
            if not request.is_started:
                request.is_started = True
                new.append(NewRequest(request_id, request.prompt_ids, request.sampling, request.num_cached_tokens or 0))
        return tuple(new)

    def _schedule_decodes(self) -> tuple[DecodeSlot, ...]:
        # A request decodes from the step after its prompt completes; it feeds its last sampled token.
        return tuple(
            DecodeSlot(request.request_id, request.last_token_id, request.num_computed_tokens)
            for request in self._running
            if request.is_prefill_done
        )

    def _schedule_prefill(self, token_budget: int) -> PrefillChunk | None:
        request = next((r for r in self._running if not r.is_prefill_done), None)
        if request is None or token_budget < 1:
            return None
        if request.num_cached_tokens is None:
            # Prompt logprobs come out of the prefill itself: a request asking for them prefills every token.
            match = self._prefix_match if request.sampling.prompt_logprobs is None else None
            request.num_cached_tokens = match(request.request_id, request.prompt_ids) if match else 0
            request.num_computed_tokens = request.num_cached_tokens
        start = request.num_computed_tokens
        end = start + min(request.num_remaining_prompt_tokens, token_budget)
        if self.config.prefix_cache_bytes:
            end = aligned_chunk_end(start, end, request.num_prompt_tokens, BLOCK_TOKENS)
        return PrefillChunk(
            request.request_id, request.prompt_ids[start:end], start, is_last=end == request.num_prompt_tokens
        )

    # ---- after the step -------------------------------------------------------------------------

    def postprocess(self, plan: StepPlan, output: StepOutput) -> list[RequestEvent]:
        """Advance every request the plan ran; return their events in order (decodes first, then the prefill).

        Requests aborted while the step ran are skipped: their Done was already sent."""
        sampled = {sample.request_id: sample for sample in output.sampled}
        events: list[RequestEvent] = []
        for slot in plan.decodes:
            request = self._requests.get(slot.request_id)
            if request is not None:
                request.num_computed_tokens += 1
                events += self._accept_sample(request, sampled.get(slot.request_id))
        if plan.prefill is not None:
            prompt_logprobs = {entry.request_id: entry for entry in output.prompt_logprobs}
            events += self._advance_prefill(plan.prefill, sampled, prompt_logprobs.get(plan.prefill.request_id))
        return events

    def _advance_prefill(self, chunk: PrefillChunk, sampled: dict[str, SampledToken],
                         prompt_logprobs: PromptLogprobs | None) -> list[RequestEvent]:
        request = self._requests.get(chunk.request_id)
        if request is None:
            return []
        request.num_computed_tokens += len(chunk.token_ids)
        events: list[RequestEvent] = [(request, prompt_logprobs)] if prompt_logprobs is not None else []
        events.append((request, Progress(
            request.num_computed_tokens, request.num_prompt_tokens, request.num_cached_tokens or 0
        )))
        if chunk.is_last:
            events += self._accept_sample(request, sampled.get(chunk.request_id))
        return events

    def _accept_sample(self, request: Request, sample: SampledToken | None) -> list[RequestEvent]:
        if sample is None:
            return self._finish(request, "error", Error(f"the runner sampled no token for {request.request_id!r}"))
        request.append_output(sample.token_id, self._clock())
        if self._is_stop_token(request, sample.token_id):
            return self._finish(request, "stop")  # the stop token is counted, not streamed (protocol.Done)
        events: list[RequestEvent] = [(request, Token(sample.token_id, sample.logprob, sample.top_logprobs))]
        if self._is_length_reached(request):
            events += self._finish(request, "length")
        return events

    def _is_stop_token(self, request: Request, token_id: int) -> bool:
        if token_id in request.sampling.stop_token_ids:
            return True
        return token_id in self._eos_token_ids and not request.sampling.ignore_eos

    def _is_length_reached(self, request: Request) -> bool:
        return (
            request.num_output_tokens >= request.sampling.max_tokens
            or request.num_tokens >= self.config.max_model_len
        )

    # ---- ending requests --------------------------------------------------------------------------

    def abort(self, request_id: str) -> list[RequestEvent]:
        """End a waiting or running request now; its reservation is freed at once. Unknown ids: no events."""
        request = self._requests.get(request_id)
        return [] if request is None else self._finish(request, "abort")

    def abort_all(self) -> list[RequestEvent]:
        return [event for request_id in self.request_ids for event in self.abort(request_id)]

    def fail(self, request_ids: Iterable[str], message: str) -> list[RequestEvent]:
        """End these requests with an internal Error (a step that ran them raised)."""
        events: list[RequestEvent] = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                events += self._finish(request, "error", Error(message, kind="internal"))
        return events

    def _finish(self, request: Request, reason: FinishReason, event: Event | None = None) -> list[RequestEvent]:
        """Remove the request from the queues, free its reservation, and say how its stream ends."""
        if request.is_running:
            self._running.remove(request)
        elif request.is_waiting:
            self._waiting.remove(request)
        del self._requests[request.request_id]
        request.reserved_bytes = 0
        if request.is_started:
            self._finished_ids.append(request.request_id)
        request.finish(reason, self._clock())
        if event is None:
            event = Done(reason, request.num_prompt_tokens, request.num_output_tokens, request.timings)
        return [(request, event)]
