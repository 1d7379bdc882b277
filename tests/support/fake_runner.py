"""A Runner without a model: deterministic tokens, optional delay and failure injection. For tests.

It also checks what a real runner relies on: a request is added before it runs, prefill chunks arrive in
order and contiguous, a decode feeds the position right after the last one, and nothing runs after release.
A scheduler or engine-loop bug that breaks one of these fails the step loudly instead of passing silently.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from tessera.engine.serving.protocol import (
    DecodeSlot,
    PrefillChunk,
    PromptLogprob,
    PromptLogprobs,
    SampledToken,
    SamplingParams,
    StepOutput,
    StepPlan,
)


class InjectedFailure(RuntimeError):
    """What ScriptedRunner raises when `fail_when` says so."""


class InjectedCrash(BaseException):
    """What ScriptedRunner raises when `crash_when` says so: not an Exception, so nothing in the engine loop
    handles it and its thread dies (as with a fatal error the loop cannot survive)."""


@dataclass
class _Sequence:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    num_fed_tokens: int = 0  # tokens written to this sequence's (imaginary) cache
    num_sampled: int = 0


@dataclass
class ScriptedRunner:
    """Emits `scripts[request_id]` in order, then (or without a script) `default_token(prompt, i)`.

    fail_when: called with each plan before it runs; True makes `execute` raise InjectedFailure.
    step_delay_s: sleep per step, to let tests act while a step is in flight.
    bytes_per_token: the cache model behind `cache_bytes_at` (linear in tokens).
    """

    scripts: Mapping[str, Sequence[int]] = field(default_factory=dict)
    vocab_size: int = 1000
    step_delay_s: float = 0.0
    fail_when: Callable[[StepPlan], bool] | None = None
    crash_when: Callable[[StepPlan], bool] | None = None
    bytes_per_token: int = 1024
    executed_plans: list[StepPlan] = field(default_factory=list, init=False)
    added_ids: list[str] = field(default_factory=list, init=False)
    released_ids: list[str] = field(default_factory=list, init=False)
    _sequences: dict[str, _Sequence] = field(default_factory=dict, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False)  # tests read while a step runs

    # ---- Runner protocol ---------------------------------------------------------------------------

    def match_prefix(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        return 0  # no prefix cache

    def add_request(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        with self._lock:
            if request_id in self._sequences:
                raise RuntimeError(f"request {request_id!r} added twice")
            self._sequences[request_id] = _Sequence(tuple(prompt_ids), sampling)
            self.added_ids.append(request_id)

    def execute(self, plan: StepPlan) -> StepOutput:
        """As a real runner: release the plan's finished requests, add its new ones, run its tokens. Plans that
        only release are not recorded in `executed_plans` (they run no step a metric would count)."""
        for request_id in plan.finished_request_ids:
            self.release(request_id)
        for new in plan.new_requests:
            self.add_request(new.request_id, new.prompt_ids, new.sampling)
        if plan.num_tokens == 0:
            return StepOutput()
        return self._run(plan)

    def _run(self, plan: StepPlan) -> StepOutput:
        started = time.perf_counter()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        with self._lock:
            self.executed_plans.append(plan)
            if self.fail_when is not None and self.fail_when(plan):
                raise InjectedFailure(f"injected failure in a step running {', '.join(plan.request_ids)}")
            if self.crash_when is not None and self.crash_when(plan):
                raise InjectedCrash(f"injected crash in a step running {', '.join(plan.request_ids)}")
            sampled = [self._decode(slot) for slot in plan.decodes]
            prompt_logprobs = ()
            if plan.prefill is not None:
                prompt_logprobs = self._prompt_logprobs(plan.prefill)
                sampled += self._prefill(plan.prefill)
        return StepOutput(sampled=tuple(sampled), prompt_logprobs=prompt_logprobs,
                          stage_seconds={"other": time.perf_counter() - started})

    def _prompt_logprobs(self, chunk: PrefillChunk) -> tuple[PromptLogprobs, ...]:
        """Plausible prompt logprobs (position p: -p / 10) for the chunk's positions, when asked for."""
        seq = self._sequence(chunk.request_id)
        num_top = seq.sampling.prompt_logprobs
        if num_top is None:
            return ()
        end = min(chunk.start + len(chunk.token_ids), len(seq.prompt_ids) - 1)
        entries = []
        for position in range(chunk.start + 1, end + 1):
            token_id = seq.prompt_ids[position]
            top = tuple(((token_id + i + 1) % self.vocab_size, -0.01 * (i + 1)) for i in range(num_top))
            entries.append(PromptLogprob(token_id, -position / 10, top))
        return (PromptLogprobs(chunk.request_id, chunk.start + 1, tuple(entries)),)

    def release(self, request_id: str) -> None:
        with self._lock:
            if self._sequences.pop(request_id, None) is None:
                raise RuntimeError(f"request {request_id!r} released but never added, or released twice")
            self.released_ids.append(request_id)

    def cache_bytes_at(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    def memory_snapshot(self) -> dict[str, int]:
        with self._lock:
            num_cached_tokens = sum(seq.num_fed_tokens for seq in self._sequences.values())
        return {"weights": 0, "kv_cache": num_cached_tokens * self.bytes_per_token, "planned_workspace": 0}

    # ---- helpers for tests -------------------------------------------------------------------------

    @property
    def live_ids(self) -> set[str]:
        """Requests added and not yet released (whose cache a real runner would still hold)."""
        with self._lock:
            return set(self._sequences)

    def default_token(self, prompt_ids: Sequence[int], index: int) -> int:
        """The i-th generated token without a script: a fixed function of the prompt, never of the batch."""
        return (sum(prompt_ids) * 31 + index * 7 + 1) % self.vocab_size

    def expected_tokens(self, request_id: str, prompt_ids: Sequence[int], num_tokens: int) -> list[int]:
        return [self._token(request_id, tuple(prompt_ids), i) for i in range(num_tokens)]

    # ---- internals -------------------------------------------------------------------------------

    def _sequence(self, request_id: str) -> _Sequence:
        seq = self._sequences.get(request_id)
        if seq is None:
            raise RuntimeError(f"request {request_id!r} runs but was never added, or was already released")
        return seq

    def _prefill(self, chunk: PrefillChunk) -> list[SampledToken]:
        seq = self._sequence(chunk.request_id)
        expected = seq.prompt_ids[seq.num_fed_tokens : seq.num_fed_tokens + len(chunk.token_ids)]
        if chunk.start != seq.num_fed_tokens or chunk.token_ids != expected or not chunk.token_ids:
            raise RuntimeError(f"prefill of {chunk.request_id!r} at {chunk.start} does not continue its prompt")
        seq.num_fed_tokens += len(chunk.token_ids)
        if chunk.is_last != (seq.num_fed_tokens == len(seq.prompt_ids)):
            raise RuntimeError(f"prefill of {chunk.request_id!r}: is_last is wrong")
        return [self._sample(chunk.request_id, seq)] if chunk.is_last else []

    def _decode(self, slot: DecodeSlot) -> SampledToken:
        seq = self._sequence(slot.request_id)
        if slot.position != seq.num_fed_tokens or seq.num_sampled == 0:
            raise RuntimeError(f"decode of {slot.request_id!r} at {slot.position}, expected {seq.num_fed_tokens}")
        if slot.token_id != self._token(slot.request_id, seq.prompt_ids, seq.num_sampled - 1):
            raise RuntimeError(f"decode of {slot.request_id!r} feeds a token it was not given")
        seq.num_fed_tokens += 1
        return self._sample(slot.request_id, seq)

    def _sample(self, request_id: str, seq: _Sequence) -> SampledToken:
        token_id = self._token(request_id, seq.prompt_ids, seq.num_sampled)
        seq.num_sampled += 1
        num_logprobs = seq.sampling.logprobs
        if num_logprobs is None:
            return SampledToken(request_id, token_id)
        # Plausible shape only: chosen token most likely, alternatives after it in descending order.
        top = tuple((token_id + i) % self.vocab_size for i in range(num_logprobs))
        return SampledToken(request_id, token_id, -0.5, tuple((t, -0.5 - i) for i, t in enumerate(top)))

    def _token(self, request_id: str, prompt_ids: tuple[int, ...], index: int) -> int:
        script = self.scripts.get(request_id, ())
        return script[index] if index < len(script) else self.default_token(prompt_ids, index)
