"""One choice's generation on the asyncio side: engine events -> text pieces.

Each choice of a response is one engine request (`ChoiceRun`). Its token events are detokenized
incrementally (never a broken UTF-8 character), then run through the stop-string matcher, which holds
back text that could still become a stop string and ends the request at the first match: the stop
string is never emitted, and the engine request is aborted so its cache is freed at once.
Chat-specific parsing (reasoning, DSML tool calls) sits on top of these pieces, in routes' handlers.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from tessera.engine.serving.protocol import (
    AdmissionError,
    Done,
    EngineClient,
    Error,
    Event,
    Progress,
    PromptLogprob,
    PromptLogprobs,
    SamplingParams,
    Token,
)
from tessera.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tessera.server.errors import APIError, internal_error, invalid_request, overloaded, unavailable
from tessera.server.metrics import Metrics


@dataclass
class Piece:
    """What one choice produced since its previous piece."""

    text: str = ""
    tokens: list[Token] = field(default_factory=list)  # consumed token events, for logprobs
    finish_reason: str | None = None  # set on a choice's last piece only: "stop" | "length"
    is_keepalive: bool = False  # prefill progress: nothing to send but a comment


class StopMatcher:
    """Finds stop strings in streamed text, across any split into pieces.

    Emitted text never contains a stop string; text that is a prefix of one is held until decided.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._max_held = max((len(stop) - 1 for stop in self._stops), default=0)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string matched — the end of output)."""
        buffer = self._pending + text
        hits = [i for i in (buffer.find(stop) for stop in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            return buffer[: min(hits)], True
        held = self._held_len(buffer)
        self._pending = buffer[len(buffer) - held :]
        return buffer[: len(buffer) - held], False

    def flush(self) -> str:
        """End of output without a match: the held text was not a stop string after all."""
        rest, self._pending = self._pending, ""
        return rest

    def _held_len(self, buffer: str) -> int:
        for n in range(min(len(buffer), self._max_held), 0, -1):
            tail = buffer[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0


def engine_error(event: Error) -> APIError:
    """An Error event -> the status it is reported with (before the first token) or in the stream."""
    if event.kind == "rejected":
        return invalid_request(event.message)
    if event.kind == "overloaded":
        return overloaded(event.message)
    return internal_error(f"The engine failed while running this request: {event.message}")


class ChoiceRun:
    """One engine request behind one choice: submit, hold the first event, then yield pieces.

    Every event is reported to the request's metrics tracker as it arrives; a refusal, a stop string or an early
    close is reported as the client sees it (server/metrics.py RequestTracker)."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Tokenizer,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stops: Sequence[str],
        inflight: set[str],
        metrics: Metrics,
        skip_special_tokens: bool = True,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_generated_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache restored (every prefill chunk's Progress says)
        self._engine = engine
        self._tracker = metrics.track(len(prompt_ids))  # arrival: just before the engine sees the request
        self._events: AsyncIterator[Event] = engine.generate(request_id, list(prompt_ids), sampling)
        self._first: Event | None = None
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.prompt_logprobs: list[PromptLogprob] = []  # filled during prefill when the request asked for them
        self._stop = StopMatcher(stops)
        self._is_finished = False
        self._inflight = inflight  # the app's live request ids: a draining server waits for them to end
        inflight.add(request_id)

    async def open(self) -> None:
        """Wait for the first engine event, so a rejection (AdmissionError, Error) is a real HTTP status."""
        try:
            self._first = await self._receive()
        except AdmissionError as exc:  # raised by the first __anext__, before any event
            self._tracker.on_rejected(exc.reason)
            raise
        if isinstance(self._first, Error):
            raise engine_error(self._first)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The choice's output; the last piece carries finish_reason. Aborts the engine request if left early."""
        try:
            while not self._is_finished:
                yield self._on_event(await self._next_event())
        finally:
            await self.close()

    async def close(self) -> None:
        """Idempotent: abort an unfinished engine request (disconnect, stop string, failure) and forget it."""
        self._inflight.discard(self.request_id)
        self._tracker.on_closed("abort")  # client gone or a failure; a no-op once the request has finished
        if not self._is_finished:
            self._is_finished = True
            self._engine.abort(self.request_id)
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _next_event(self) -> Event:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        event = await self._receive()
        if event is None:
            raise internal_error("The engine ended a request's stream without a final event")
        return event

    async def _receive(self) -> Event | None:
        """The engine's next event, recorded in metrics on arrival (TTFT is taken here); None: the stream ended."""
        try:
            event = await self._events.__anext__()
        except StopAsyncIteration:
            return None
        self._tracker.on_event(event)
        return event

    def _on_event(self, event: Event) -> Piece:
        if isinstance(event, Token):
            return self._on_token(event)
        if isinstance(event, Progress):
            self.num_cached_tokens = event.num_cached_tokens
            return Piece(is_keepalive=True)
        if isinstance(event, PromptLogprobs):
            self.prompt_logprobs.extend(event.entries)  # arrive in prompt order, before the first token
            return Piece(is_keepalive=True)
        if isinstance(event, Done):
            return self._on_done(event)
        raise engine_error(event)

    def _on_token(self, token: Token) -> Piece:
        self.num_generated_tokens += 1
        text, is_stopped = self._stop.feed(self._detokenizer.feed(token.token_id))
        if is_stopped:
            self._finish_early()
            return Piece(text, [token], finish_reason="stop")
        return Piece(text, [token])

    def _on_done(self, done: Done) -> Piece:
        if done.finish_reason == "abort":
            raise unavailable("The request was aborted because the server is shutting down")
        if done.finish_reason == "error":
            raise internal_error("The engine failed while running this request")
        self._is_finished = True
        self.num_generated_tokens = done.num_generated_tokens  # counts the stop token, which is never sent
        text, is_stopped = self._stop.feed(self._detokenizer.flush())
        if not is_stopped:
            text += self._stop.flush()
        return Piece(text, finish_reason="stop" if is_stopped else done.finish_reason)

    def _finish_early(self) -> None:
        """A stop string ended the output: free the engine request now instead of letting it run on."""
        self._is_finished = True
        self._tracker.on_closed("stop")
        self._engine.abort(self.request_id)


async def open_runs(runs: list[ChoiceRun]) -> None:
    """Open every run concurrently; if any is refused (or we are cancelled), close them all and raise."""
    try:
        results = await asyncio.gather(*(run.open() for run in runs), return_exceptions=True)
    except BaseException:
        await close_runs(runs)
        raise
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        await close_runs(runs)
        raise failure


async def close_runs(runs: list[ChoiceRun]) -> None:
    for run in runs:
        await run.close()


async def merge_pieces(runs: list[ChoiceRun]) -> AsyncIterator[tuple[int, Piece]]:
    """Interleave the runs' pieces as they come, tagged with the run's index (n > 1 streaming)."""
    if len(runs) == 1:
        async with aclosing(runs[0].pieces()) as pieces:
            async for piece in pieces:
                yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, run: ChoiceRun) -> None:
        try:
            async for piece in run.pieces():
                await queue.put((index, piece))
            await queue.put((index, None))
        except Exception as exc:  # reported through the queue; the consumer raises it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
    try:
        num_open = len(runs)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_runs(runs)


async def collect(run: ChoiceRun) -> list[Piece]:
    """A whole choice, for non-streamed responses."""
    return [piece async for piece in run.pieces() if not piece.is_keepalive]


async def collect_all(runs: list[ChoiceRun]) -> list[list[Piece]]:
    """Every choice concurrently; the first failure aborts the others."""
    tasks = [asyncio.ensure_future(collect(run)) for run in runs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_runs(runs)
