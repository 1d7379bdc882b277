"""Faults injected into the engine (tests/support/fake_runner.py): a request whose step raises fails alone,
its neighbours finish exactly as without it; a dead engine thread is terminal and visible at once (issue 18)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from tessera.engine.serving.engine_loop import AsyncEngine
from tessera.engine.serving.protocol import AdmissionError, Done, Error, SamplingParams, StepPlan, Token
from tessera.engine.serving.scheduler import SchedulerConfig
from server_harness import live_server
from tests.support.fake_runner import ScriptedRunner

TIMEOUT_S = 10.0


def make_engine(runner: ScriptedRunner, **config: Any) -> AsyncEngine:
    engine = AsyncEngine(runner, SchedulerConfig(**{"prefill_chunk": 64, "max_num_seqs": 8, **config}))
    engine.start()
    return engine


async def events_of(engine: AsyncEngine, request_id: str, prompt: list[int], max_tokens: int) -> list:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def run() -> list:
        return [event async for event in engine.generate(request_id, prompt, sampling)]

    return await asyncio.wait_for(run(), TIMEOUT_S)


def decodes(request_id: str, after: int):
    """fail_when / crash_when: the plan decodes `request_id` at a position past its prompt + `after` tokens."""
    def when(plan: StepPlan) -> bool:
        return any(slot.request_id == request_id and slot.position >= after for slot in plan.decodes)
    return when


@pytest.mark.parametrize("bad_index", [0, 3, 6])
def test_a_request_that_fails_its_step_fails_alone(bad_index: int):
    ids = [f"r{i}" for i in range(7)]
    bad = ids[bad_index]
    prompts = {rid: [10 + i, 20 + i, 30 + i] for i, rid in enumerate(ids)}
    runner = ScriptedRunner(fail_when=decodes(bad, after=3 + 2))  # mid-answer, in a batch with all the others
    engine = make_engine(runner)

    async def main() -> list[list]:
        return await asyncio.gather(*(events_of(engine, rid, prompts[rid], 12) for rid in ids))

    results = dict(zip(ids, asyncio.run(main())))
    failed = results.pop(bad)
    assert isinstance(failed[-1], Error) and failed[-1].kind == "internal"
    assert bad in failed[-1].message and "Injected" not in failed[-1].message  # generic, with its id
    assert [e.token_id for e in failed if isinstance(e, Token)] == runner.expected_tokens(bad, prompts[bad], 3)
    for rid, events in results.items():  # every neighbour mid-answer finished, with exactly its own tokens
        assert events[-1] == Done("length", 3, 12), (rid, events[-1])
        assert [e.token_id for e in events if isinstance(e, Token)] == runner.expected_tokens(rid, prompts[rid], 12)
    deadline = time.monotonic() + TIMEOUT_S
    while runner.live_ids and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not runner.live_ids and engine.stats().is_alive
    engine.shutdown(1.0)


def test_a_dead_engine_fails_every_request_at_once_and_refuses_new_ones():
    runner = ScriptedRunner(crash_when=decodes("a", after=2 + 3), step_delay_s=0.002)
    engine = make_engine(runner)
    deaths: list[float] = []
    engine.on_death(lambda: deaths.append(time.monotonic()))

    async def main() -> list:
        waiting = [events_of(engine, f"w{i}", [5, 6], 1000) for i in range(3)]
        return await asyncio.gather(events_of(engine, "a", [1, 2], 1000), *waiting)

    started = time.monotonic()
    results = asyncio.run(main())
    assert all(isinstance(events[-1], Error) for events in results), [events[-1] for events in results]
    # the owner is told right after the requests' errors are dispatched, from the engine thread
    while not deaths and time.monotonic() - started < 5.0:
        time.sleep(0.01)
    assert time.monotonic() - started < 5.0 and len(deaths) == 1
    assert not engine.stats().is_alive
    with pytest.raises(AdmissionError):
        asyncio.run(events_of(engine, "late", [1, 2], 2))
    engine.shutdown(1.0)  # still returns


def test_over_http_one_poisoned_request_fails_alone_with_a_generic_500(tokenizer):
    with live_server(tokenizer, step_delay_s=0.002) as live:
        live.runner.fail_marker, live.runner.fail_after_tokens = "poison", 2
        body = {"model": "tessera-test", "max_tokens": 8, "ignore_eos": True}
        responses: dict[str, httpx.Response] = {}

        def send(name: str) -> None:
            responses[name] = httpx.post(live.base_url + "/v1/completions", json={**body, "prompt": name}, timeout=30)

        threads = [threading.Thread(target=send, args=(name,)) for name in ("poison", "fine 1", "fine 2", "fine 3")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert responses["poison"].status_code == 500
        message = responses["poison"].json()["error"]["message"]
        assert "Injected" not in message and "request" in message
        for name in ("fine 1", "fine 2", "fine 3"):
            assert responses[name].status_code == 200, responses[name].text
            assert responses[name].json()["usage"]["completion_tokens"] == 8


def test_over_http_a_dead_engine_turns_ready_503_and_ends_streams_at_once(tokenizer):
    with live_server(tokenizer, step_delay_s=0.002) as live:
        assert httpx.get(live.base_url + "/ready").status_code == 200
        live.runner.crash_when = lambda plan: len(live.runner.executed_plans) > 20
        body = {"model": "tessera-test", "prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        streamed: list[str] = []

        def read_stream() -> None:  # SSE pings would keep a forgotten stream open forever: bound it from outside
            with httpx.stream("POST", live.base_url + "/v1/completions", json=body, timeout=30) as response:
                streamed.append("".join(response.iter_text()))

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        reader.join(5.0)
        assert streamed, "the stream did not end within 5 s of the engine's death"
        text = streamed[0]
        assert '"error"' in text and text.rstrip().endswith("data: [DONE]")
        errors_500 = live.scrape()[("tessera_http_errors_total",
                                    frozenset({("model_name", "tessera-test"), ("status", "500")}))]
        assert errors_500 == 1  # the in-stream error counts as the 500 it would have been
        ready = httpx.get(live.base_url + "/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "engine_dead" and ready.headers["retry-after"]
        assert httpx.get(live.base_url + "/health").status_code == 503
        late = httpx.post(live.base_url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert late.status_code == 503 and late.headers["retry-after"]


# ---- the real runner leaves a failed step's requests as they were ------------------------------------------


def test_model_runner_rolls_back_a_step_that_raised_after_writing_its_caches(tmp_path):
    from tessera.engine.serving.protocol import DecodeSlot, NewRequest, PrefillChunk
    from tessera.engine.serving.runner import build_runner
    from tessera.engine.tools.make_model import make_model

    runner = build_runner(make_model(tmp_path, "tiny", seed=3, with_tokenizer=False), prefill_chunk=64,
                          indexer_tile=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=100)
    prompts = {"a": tuple(range(1, 40)), "b": tuple(range(50, 75))}

    def start(suffix: str) -> dict[str, int]:
        last = {}
        for name, prompt in prompts.items():
            rid = name + suffix
            plan = StepPlan(prefill=PrefillChunk(rid, prompt, 0, True), new_requests=(NewRequest(rid, prompt, greedy),))
            last[rid] = runner.execute(plan).sampled[0].token_id
        return last

    def decode_steps(suffix: str, last: dict[str, int], num_steps: int) -> list[tuple[int, ...]]:
        out = []
        for step in range(num_steps):
            plan = StepPlan(decodes=tuple(DecodeSlot(name + suffix, last[name + suffix], len(prompts[name]) + step)
                                          for name in prompts))
            sampled = runner.execute(plan).sampled
            last.update({s.request_id: s.token_id for s in sampled})
            out.append(tuple(s.token_id for s in sampled))
        return out

    clean = decode_steps("1", start("1"), 3)

    last = start("2")
    real_forward = runner.model.forward

    def forward_then_fail(*args: Any, **kwargs: Any):
        real_forward(*args, **kwargs)  # every cache of the batch is written...
        raise RuntimeError("injected after the forward")  # ...and then the step fails

    runner.model.forward = forward_then_fail
    with pytest.raises(RuntimeError):
        decode_steps("2", dict(last), 1)
    runner.model.forward = real_forward
    assert decode_steps("2", last, 3) == clean  # re-run as if the failed step never happened


def test_tessera_serve_exits_non_zero_when_the_engine_dies():
    from types import SimpleNamespace

    from tessera.server.serve import _watch_engine

    callbacks: list = []
    served = SimpleNamespace(engine=SimpleNamespace(on_death=callbacks.append))
    server = SimpleNamespace(should_exit=False)

    async def main() -> bool:
        died = _watch_engine(served, server)  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        assert not server.should_exit
        threading.Thread(target=callbacks[0]).start()  # the engine thread reports its death
        await asyncio.sleep(1.0)
        return died.is_set()

    assert asyncio.run(main()) and server.should_exit  # _serve then returns 1: the process exit status
