"""Server-sent events for streamed completions (sse-starlette).

The stream is opened only after every choice's first engine event (routes hold the status until then),
so a refusal is a real HTTP error. Once the 200 is sent, a failure becomes one `data: {"error": …}` event;
every stream, failed or not, ends with `data: [DONE]`. During a long prefill the engine's Progress events
become SSE comments, and sse-starlette pings on top, so proxies never see an idle connection.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable, Union

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from tessera.server.errors import to_api_error

PING_INTERVAL_S = 10  # under the common 30-60 s idle timeouts of proxies and load balancers


class Keepalive:
    """A chunk stream item meaning 'still working' (prefill progress): sent as an SSE comment."""

    def __init__(self, note: str = "keepalive") -> None:
        self.note = note


Chunk = Union[BaseModel, Keepalive]


class _Stream(EventSourceResponse):
    """An SSE response that runs `on_close` however it ends: done, failed, or cut by a disconnect."""

    def __init__(self, chunks: AsyncIterator[Chunk], on_close: Callable[[], Awaitable[None]],
                 on_error: Callable[[int], None] | None = None, with_usage: bool = False) -> None:
        super().__init__(_events(chunks, on_error, with_usage), ping=PING_INTERVAL_S, sep="\n")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # The chunk generator may never have started (client gone at once): free its engine requests here.
            await self._on_close()


def sse_response(chunks: AsyncIterator[Chunk], on_close: Callable[[], Awaitable[None]],
                 on_error: Callable[[int], None] | None = None, with_usage: bool = False) -> EventSourceResponse:
    """`on_error(status)`: called for an error reported in-band (the metrics count it as that status).
    `with_usage` (stream_options.include_usage): every chunk has a `usage` key, null until the last one."""
    return _Stream(chunks, on_close, on_error, with_usage)


async def _events(chunks: AsyncIterator[Chunk], on_error: Callable[[int], None] | None = None,
                  with_usage: bool = False) -> AsyncIterator[ServerSentEvent]:
    try:
        async for chunk in chunks:
            yield _encode(chunk, with_usage)
    except Exception as exc:  # after the 200: report in-band, then end as usual (a disconnect is not Exception)
        error = to_api_error(exc)
        if on_error is not None:
            on_error(error.status)
        yield ServerSentEvent(data=json.dumps(error.body()))
    yield ServerSentEvent(data="[DONE]")


def _encode(chunk: Chunk, with_usage: bool) -> ServerSentEvent:
    if isinstance(chunk, Keepalive):
        return ServerSentEvent(comment=chunk.note)
    return ServerSentEvent(data=json.dumps(openai_chunk(chunk.model_dump(mode="json"), with_usage), ensure_ascii=False))


def openai_chunk(data: dict[str, Any], with_usage: bool) -> dict[str, Any]:
    """Nulls where OpenAI sends them: `finish_reason` and `logprobs` on every choice, `usage` on every chunk when
    include_usage is on. Dropped where OpenAI drops them: unset fields of a chat `delta` (a delta with only
    `content`), and `usage` without include_usage."""
    for choice in data.get("choices", []):
        delta = choice.get("delta")
        if isinstance(delta, dict):
            choice["delta"] = {key: value for key, value in delta.items() if value is not None}
    if data.get("usage") is None and not with_usage:
        data.pop("usage", None)
    return data
