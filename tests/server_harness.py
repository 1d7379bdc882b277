"""A real Tessera HTTP server for tests: uvicorn on 127.0.0.1 (free port, own thread), the real AsyncEngine
over a ScriptedRunner (no model), and a byte-level tokenizer trained by train_tokenizer. It is wired for metrics
as `tessera serve` is: the app's Metrics subscribed to the engine's steps (AppState.attach), served at /metrics.

`PromptScriptedRunner` picks a request's tokens by what its prompt says: a test registers
`script("weather?", text_tokens)` and any request whose prompt contains "weather?" emits those tokens
(server request ids are random, so scripting by id is not possible from outside).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tessera.engine.serving.engine_loop import AsyncEngine
from tests.support.fake_runner import ScriptedRunner
from tessera.engine.serving.protocol import SamplingParams, StepOutput, StepPlan
from tessera.engine.serving.scheduler import SchedulerConfig
from tessera.engine.model.tokenizer import Tokenizer
from tessera.engine.tools.tokenizer_train import train_tokenizer
from tessera.server.app import create_app
from tessera.server.metrics import Metrics
from tessera.server.prepare import ModelInfo, ServedModel
from tessera.server.serve import build_engine
from tessera.server.settings import Settings

MODEL_NAME = "tessera-test"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(**fields: Any) -> dict[str, Any]:
    """A small chat request body for MODEL_NAME; `fields` add to or replace its keys."""
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    """A small completion request body for MODEL_NAME; `fields` add to or replace its keys."""
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, **fields}


def sse_data(lines: Iterable[str]) -> list[str]:
    """The payloads of a server-sent event stream's `data: ` lines, in order (comments and blank lines dropped)."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def sse_chunks(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON chunks of a stream that must end with `data: [DONE]` (asserted)."""
    data = sse_data(lines)
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def make_tokenizer(tmp_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(train_tokenizer(tmp_dir / "tokenizer", vocab_size=2048, seed=0))


@dataclass
class PromptScriptedRunner(ScriptedRunner):
    """ScriptedRunner whose scripts are chosen by a marker in the decoded prompt.

    It records each request's prompt text and sampling, and fails (InjectedFailure, like a runner crash)
    any step touching a request whose prompt contains `fail_marker` once it has sampled `fail_after_tokens`.
    """

    tokenizer: Tokenizer | None = None
    scripts_by_marker: dict[str, list[int]] = field(default_factory=dict)
    fail_marker: str | None = None
    fail_after_tokens: int = 0
    prompt_by_id: dict[str, str] = field(default_factory=dict, init=False)
    sampling_by_id: dict[str, SamplingParams] = field(default_factory=dict, init=False)
    num_sampled_by_id: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.fail_when = self._should_fail

    def script(self, marker: str, token_ids: Sequence[int]) -> None:
        self.scripts_by_marker[marker] = list(token_ids)

    def add_request(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        assert self.tokenizer is not None
        prompt = self.tokenizer.decode(prompt_ids)
        for marker, script in self.scripts_by_marker.items():
            if marker in prompt:
                self.scripts[request_id] = script  # type: ignore[index]  # scripts is our own dict
        self.prompt_by_id[request_id] = prompt
        self.sampling_by_id[request_id] = sampling
        super().add_request(request_id, prompt_ids, sampling)

    def execute(self, plan: StepPlan) -> StepOutput:
        output = super().execute(plan)
        for sample in output.sampled:
            self.num_sampled_by_id[sample.request_id] = self.num_sampled_by_id.get(sample.request_id, 0) + 1
        return output

    def requests_with(self, marker: str) -> list[str]:
        return [rid for rid, prompt in self.prompt_by_id.items() if marker in prompt]

    def _should_fail(self, plan: StepPlan) -> bool:
        marker = self.fail_marker
        return marker is not None and any(
            marker in self.prompt_by_id.get(rid, "") and self.num_sampled_by_id.get(rid, 0) >= self.fail_after_tokens
            for rid in plan.request_ids
        )


@dataclass
class LiveServer:
    base_url: str
    runner: PromptScriptedRunner
    engine: AsyncEngine
    tokenizer: Tokenizer
    app: Any
    settings: Settings
    metrics: Metrics  # the app's own, fed by its routes and by the engine's step statistics

    def client(self, api_key: str = "none", **kwargs: Any) -> openai.OpenAI:
        return openai_client(self.base_url, api_key=api_key, **kwargs)

    def text_tokens(self, text: str, end: bool = True) -> list[int]:
        """Tokens spelling `text`, then EOS (the request ends with finish_reason 'stop') unless end=False."""
        eos = [self.tokenizer.eos_token_id] if end else []
        return self.tokenizer.encode(text) + eos  # type: ignore[list-item]

    def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """GET /metrics, parsed: {(sample name, labels): value}, as Prometheus would store it."""
        response = httpx.get(f"{self.base_url}/metrics", timeout=5)
        response.raise_for_status()
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
        }

    def wait_until_idle(self, timeout_s: float = 5.0) -> None:
        """Until the engine holds no request and the runner no sequence (cancellation freed everything)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and not self.runner.live_ids:
                return
            time.sleep(0.01)
        raise AssertionError(f"engine not idle: {self.engine.stats()}, live {self.runner.live_ids}")


def openai_client(base_url: str, api_key: str = "none", **kwargs: Any) -> openai.OpenAI:
    """The openai client for a test server: no retries (a failure shows at once)."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """Run any ASGI app under uvicorn on a free loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def live_server(
    tokenizer: Tokenizer,
    *,
    max_model_len: int = 4096,
    prefill_chunk: int = 256,
    max_num_seqs: int = 8,
    max_queued_requests: int = 64,
    memory_budget_bytes: int | None = None,
    step_delay_s: float = 0.0,
    **settings: Any,
) -> Iterator[LiveServer]:
    """The real AsyncEngine over a PromptScriptedRunner behind the real app; `settings` go to Settings."""
    runner = PromptScriptedRunner(vocab_size=tokenizer.vocab_size, step_delay_s=step_delay_s, tokenizer=tokenizer,
                                  scripts={})
    config = SchedulerConfig(prefill_chunk=prefill_chunk, max_num_seqs=max_num_seqs,
                             max_queued_requests=max_queued_requests, max_model_len=max_model_len,
                             memory_budget_bytes=memory_budget_bytes)
    app_settings = Settings(prefill_chunk=prefill_chunk, indexer_tile=min(prefill_chunk, 1024),
                            max_num_seqs=max_num_seqs, max_queued_requests=max_queued_requests, **settings)
    metrics = Metrics.from_settings(app_settings, MODEL_NAME, max_model_len)
    engine = AsyncEngine(runner, config, eos_token_ids=[tokenizer.eos_token_id])
    info = ModelInfo(name=MODEL_NAME, root="scripted", max_model_len=max_model_len, created=int(time.time()))
    app = create_app(app_settings, engine, tokenizer, info, metrics)
    engine.start()
    try:
        with serving(app) as base_url:
            yield LiveServer(base_url, runner, engine, tokenizer, app, app_settings, metrics)
    finally:
        engine.shutdown(1.0)


@contextmanager
def real_server(settings: Settings) -> Iterator[tuple[str, ServedModel]]:
    """`tessera serve`'s own wiring (build_engine + create_app) for a real model directory on a free loopback
    port: yields (base URL, the ServedModel); the engine is shut down on exit."""
    served = build_engine(settings)
    app = create_app(settings, served.engine, served.tokenizer, served.info, served.metrics)
    served.engine.start()
    try:
        with serving(app) as base_url:
            yield base_url, served
    finally:
        served.engine.shutdown(1.0)
