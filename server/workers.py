"""CPU-heavy request work off the event loop: body parsing, validation and tokenization in a bounded pool.

A 10 MB prompt takes seconds to parse, validate and tokenize; on the event loop that would stall /health and
every other stream for as long. Here it runs in at most `edge_workers` threads (anyio's thread runner with a
CapacityLimiter: requests beyond it wait for a free thread, they do not pile up threads). Tokenizing releases
the GIL (engine/model/tokenizer.py), so the loop keeps answering meanwhile.

Request JSON is also checked for lone UTF-16 surrogates (`"\\ud800"`): JSON allows the escape, but such a
string is not Unicode text, and the tokenizer (or any UTF-8 encoder) would fail on it later as a 500.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, TypeVar

import anyio
import anyio.to_thread
from fastapi import Request
from pydantic import BaseModel

from tessera.server.errors import invalid_request

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class WorkerPool:
    """At most `num_workers` threads doing request work at once."""

    def __init__(self, num_workers: int) -> None:
        self._limiter = anyio.CapacityLimiter(num_workers)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)


def parse_body(model: type[M], raw: bytes) -> M:
    """Bytes -> validated request model; every failure a 400 naming what is wrong. Blocking: call in the pool."""
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise invalid_request(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_request("Request body must be a JSON object")
    check_text(data)
    return model.model_validate(data)  # ValidationError -> 400 naming the field (server/errors.py)


def _no_constants(name: str) -> Any:
    # Python's json reads NaN / Infinity, which JSON does not have; a NaN would slip past range checks.
    raise ValueError(f"{name} is not a JSON value")


def check_text(value: Any, path: str = "") -> None:
    """Raise a 400 naming the first field whose string (or object key) holds a lone surrogate."""
    if isinstance(value, str):
        if _has_lone_surrogate(value):
            raise invalid_request(f"Invalid value for '{path}': the string contains a lone UTF-16 surrogate "
                                  "(e.g. \\ud800), which is not valid Unicode text", param=path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if _has_lone_surrogate(key):
                raise invalid_request(f"Invalid key in '{path or 'body'}': it contains a lone UTF-16 surrogate",
                                      param=path or None)
            check_text(item, child)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, (str, dict, list)):  # skip the ints of a token-id prompt fast
                check_text(item, f"{path}[{index}]")


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: the request's body parsed as `model` in the app's worker pool."""

    async def parsed(request: Request) -> M:
        raw = await request.body()  # already buffered by app.EdgeGuard, within max_body_bytes
        pool: WorkerPool = request.app.state.tessera.workers
        return await pool.run(parse_body, model, raw)

    return parsed
