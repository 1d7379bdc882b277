"""Adapter that lets llama.cpp's server test files (tools/server/tests/unit/*.py) run against an
already running `tessera serve`, for issue 15's "peer suites" check (results: docs/BENCHMARKS.md).

No peer code lives here. Usage: copy this file as `utils.py` next to the peer test files in a scratch
directory, add a conftest.py holding `from utils import server_factory`, start
`tessera serve --port 8123`, then run pytest there (TESSERA_URL overrides the address).

The peer's ServerProcess launches llama-server with flags; here `start()` only checks that the running
server answers, and llama.cpp's un-prefixed OpenAI paths (/chat/completions, /completions, /models)
are mapped to /v1/... . llama.cpp-only paths (/completion, /slots, /apply-template) are sent as they
are, so a test that needs them fails and is classified as "peer differs from OpenAI".
"""
from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest
import requests

BASE_URL = os.environ.get("TESSERA_URL", "http://127.0.0.1:8123")
# llama-server ignores the request's `model` (and accepts none); OpenAI and Tessera answer 400 when it is
# missing and 404 when it is unknown. Pass 1 runs with this off to count those failures; pass 2
# (TESSERA_NORMALISE_MODEL=1) sends the served name instead so the rest of each test is exercised.
NORMALISE_MODEL = os.environ.get("TESSERA_NORMALISE_MODEL") == "1"
# llama.cpp serves the OpenAI routes both with and without the /v1 prefix; Tessera only with it.
OPENAI_PATHS = ("/chat/completions", "/completions", "/models", "/embeddings")


@dataclass
class ServerResponse:
    status_code: int
    headers: dict
    body: Any


class ServerError(Exception):
    def __init__(self, code: int, body: Any):
        super().__init__(f"HTTP {code}: {body}")
        self.code = code
        self.body = body


class ServerProcess:
    """The peer's server handle, reduced to talking to one running Tessera.

    Attributes the peer tests set (jinja, chat_template, n_slots, ...) are accepted and have no
    effect: the server under test was started once with its own settings."""

    def __init__(self) -> None:
        host_port = BASE_URL.split("://", 1)[1]
        self.server_host, port = host_port.rsplit(":", 1)
        self.server_port = int(port)
        self.n_ctx = None
        self.n_slots = None
        self.n_predict = None
        self.seed = None
        self.model_alias = None

    def start(self, timeout_seconds: int = 10) -> None:
        res = requests.get(f"{BASE_URL}/health", timeout=timeout_seconds)
        assert res.status_code == 200, "start `tessera serve` first"

    def stop(self) -> None:
        pass

    def _url(self, path: str) -> str:
        if path.startswith(OPENAI_PATHS):
            path = "/v1" + path
        return BASE_URL + path

    def make_request(self, method: str, path: str, data: dict | Any | None = None,
                     headers: dict | None = None, timeout: float | None = None) -> ServerResponse:
        data = _with_served_model(data)
        res = requests.request(method, self._url(path), headers=headers, json=data, timeout=timeout or 120)
        try:
            body = res.json()
        except ValueError:
            body = res.text
        return ServerResponse(res.status_code, dict(res.headers), body)

    def make_stream_request(self, method: str, path: str, data: dict | None = None,
                            headers: dict | None = None) -> Iterator[dict]:
        data = _with_served_model(data)
        res = requests.request(method, self._url(path), headers=headers, json=data, stream=True, timeout=120)
        if res.status_code != 200:
            raise ServerError(res.status_code, res.json())
        for line in res.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            yield json.loads(payload)

    def __getattr__(self, name: str) -> Any:
        # Launch flags the peer tests set or read (jinja, n_batch, debug, ...): None, never an error.
        return None

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)


def served_model_name() -> str:
    return requests.get(f"{BASE_URL}/v1/models", timeout=10).json()["data"][0]["id"]


def _with_served_model(data: Any) -> Any:
    if NORMALISE_MODEL and isinstance(data, dict):
        return {**data, "model": served_model_name()}
    return data


def _patch_openai_client_model() -> None:
    """Pass 2 only: the peer's openai-SDK calls name OpenAI models (gpt-3.5-turbo-instruct, davinci-002)."""
    from openai.resources.chat.completions import Completions as ChatCompletions
    from openai.resources.completions import Completions

    for cls in (ChatCompletions, Completions):
        original = cls.create

        def create(self, *args, _original=original, **kwargs):
            kwargs["model"] = served_model_name()
            return _original(self, *args, **kwargs)

        cls.create = create


if NORMALISE_MODEL:
    _patch_openai_client_model()


class ServerPreset:
    """Every preset is the one running server (Tessera's default random-weight model)."""

    def __getattr__(self, name: str) -> Callable[[], ServerProcess]:
        return ServerProcess


ServerPreset = ServerPreset()  # type: ignore[misc]  # the peer calls ServerPreset.tinyllama2()


@pytest.fixture
def server_factory():
    return lambda *_args, **_kwargs: ServerProcess()


def match_regex(regex: str, text: str) -> bool:
    return re.compile(regex, flags=re.IGNORECASE | re.MULTILINE | re.DOTALL).search(text) is not None


def parallel_function_calls(function_list: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(function_list)) as pool:
        futures = [pool.submit(fn, *args) for fn, args in function_list]
        return [f.result() for f in futures]
