"""The engine thread and its asyncio bridge, on a ScriptedRunner (no model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tessera.engine.serving.engine_loop import AsyncEngine, EngineLoop
from tests.support.fake_runner import ScriptedRunner
from tessera.engine.serving.protocol import AdmissionError, Done, Error, Progress, SamplingParams, StepStats, Token
from tessera.engine.serving.request import Request
from tessera.engine.serving.scheduler import SchedulerConfig

TIMEOUT_S = 10.0


def make_engine(runner: ScriptedRunner, **config) -> AsyncEngine:
    config = {"prefill_chunk": 8, "max_num_seqs": 4, **config}
    engine = AsyncEngine(runner, SchedulerConfig(**config), eos_token_ids=(0,))
    engine.start()
    return engine


async def collect(engine: AsyncEngine, request_id: str, prompt_ids, **sampling) -> list:
    async def run():
        return [event async for event in engine.generate(request_id, prompt_ids, SamplingParams(**sampling))]

    return await asyncio.wait_for(run(), TIMEOUT_S)


async def drain(stream) -> list:
    async def run():
        return [event async for event in stream]

    return await asyncio.wait_for(run(), TIMEOUT_S)


def wait_until(predicate, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


def test_tokens_arrive_in_order_then_done():
    runner = ScriptedRunner(scripts={"r": [5, 6, 7]})
    engine = make_engine(runner)

    events = asyncio.run(collect(engine, "r", range(1, 21), max_tokens=3))

    assert events == [
        Progress(8, 20), Progress(16, 20), Progress(20, 20), Token(5), Token(6), Token(7), Done("length", 20, 3)
    ]
    wait_until(lambda: runner.released_ids == ["r"])
    engine.shutdown(timeout=1.0)


def test_concurrent_requests_each_get_their_own_tokens():
    runner = ScriptedRunner()
    engine = make_engine(runner, max_num_seqs=3)
    prompts = {f"r{i}": list(range(i, i + 5 + 3 * i)) for i in range(8)}

    async def main():
        streams = (collect(engine, rid, p, max_tokens=6, ignore_eos=True) for rid, p in prompts.items())
        return await asyncio.gather(*streams)

    for (request_id, prompt), events in zip(prompts.items(), asyncio.run(main())):
        tokens = [e.token_id for e in events if isinstance(e, Token)]
        assert tokens == runner.expected_tokens(request_id, prompt, 6)
        assert events[-1] == Done("length", len(prompt), 6)
    wait_until(lambda: not runner.live_ids)
    engine.shutdown(timeout=1.0)


def test_admission_errors_are_raised_before_any_event():
    engine = make_engine(ScriptedRunner(step_delay_s=0.01), max_model_len=16, max_num_seqs=1, max_queued_requests=0)

    async def main():
        stream = engine.generate("long", range(1, 17), SamplingParams())
        with pytest.raises(AdmissionError) as too_long:
            await stream.__anext__()
        assert too_long.value.reason == "too_long"

        first = engine.generate("first", [1, 2], SamplingParams(max_tokens=1000))
        assert isinstance(await first.__anext__(), Progress)
        with pytest.raises(AdmissionError) as full:
            engine.submit("second", [1, 2], SamplingParams())  # the plain handle raises at the call itself
        assert full.value.reason == "queue_full"
        await first.aclose()

    asyncio.run(main())
    engine.shutdown(timeout=1.0)


def test_abort_mid_stream_ends_the_stream_and_releases_within_one_step():
    runner = ScriptedRunner(step_delay_s=0.002)
    engine = make_engine(runner)

    async def main():
        events = []
        async for event in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=100_000)):
            events.append(event)
            if sum(isinstance(e, Token) for e in events) == 3:
                num_plans_at_abort = len(runner.executed_plans)
                engine.abort("r")
        return events, num_plans_at_abort

    events, num_plans_at_abort = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))

    assert events[-1] == Done("abort", 3, events[-1].num_generated_tokens)
    wait_until(lambda: "r" in runner.released_ids)
    # At most the step already in flight at abort time ran it; none after.
    assert all("r" not in plan.request_ids for plan in runner.executed_plans[num_plans_at_abort + 1 :])
    assert engine.stats().num_running == 0
    engine.shutdown(timeout=1.0)


def test_leaving_the_stream_early_aborts_and_releases():
    runner = ScriptedRunner(step_delay_s=0.002)
    engine = make_engine(runner)

    async def main():
        stream = engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=100_000))
        async for event in stream:
            if isinstance(event, Token):
                break
        await stream.aclose()  # what a server does when the client disconnects

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    wait_until(lambda: "r" in runner.released_ids and not runner.live_ids)
    engine.shutdown(timeout=1.0)


def test_runner_failure_fails_only_the_requests_of_that_step():
    runner = ScriptedRunner(fail_when=lambda plan: plan.prefill is not None and plan.prefill.request_id == "bad")
    engine = make_engine(runner)
    steps: list[StepStats] = []
    engine.subscribe(steps.append)

    async def main():
        return await asyncio.gather(
            collect(engine, "bad", [1, 2, 3], max_tokens=4), collect(engine, "good", [4, 5, 6], max_tokens=4)
        )

    bad, good = asyncio.run(main())

    assert len(bad) == 1 and isinstance(bad[0], Error) and bad[0].kind == "internal"
    assert "bad" in bad[0].message and "Injected" not in bad[0].message  # its id; the detail is in the log
    assert good[-1] == Done("length", 3, 4)
    wait_until(lambda: not runner.live_ids and "bad" in runner.released_ids)
    # The loop is still alive and serves new requests.
    assert asyncio.run(collect(engine, "after", [7, 8], max_tokens=2))[-1] == Done("length", 2, 2)
    assert sum(step.failed for step in steps) == 1 and engine.stats().is_alive
    failed = next(step for step in steps if step.failed)
    assert failed.num_sampled_tokens == 0 and failed.stage_seconds == {}
    engine.shutdown(timeout=1.0)


def test_shutdown_lets_in_flight_requests_finish_then_refuses_new_ones():
    runner = ScriptedRunner(step_delay_s=0.001)
    engine = make_engine(runner)

    async def main():
        sampling = SamplingParams(max_tokens=20, ignore_eos=True)
        streams = [drain(engine.submit(f"r{i}", [i + 1, 2, 3], sampling)) for i in range(3)]
        return await asyncio.gather(*streams, asyncio.to_thread(engine.shutdown, 5.0))

    *results, _ = asyncio.run(main())

    for events in results:
        assert events[-1] == Done("length", 3, 20)
    stats = engine.stats()
    assert not stats.is_alive and not stats.is_accepting
    assert not runner.live_ids
    with pytest.raises(AdmissionError) as refused:
        asyncio.run(collect(engine, "late", [1], max_tokens=1))
    assert refused.value.reason == "shutting_down" and refused.value.is_overload


def test_shutdown_aborts_what_does_not_finish_in_time():
    runner = ScriptedRunner(step_delay_s=0.002)
    engine = make_engine(runner)

    async def main():
        stream = engine.submit("endless", [1, 2], SamplingParams(max_tokens=1_000_000, ignore_eos=True))
        return await asyncio.gather(drain(stream), asyncio.to_thread(engine.shutdown, 0.05))

    events, _ = asyncio.run(main())
    assert events[-1].finish_reason == "abort"
    assert not runner.live_ids and not engine.stats().is_alive


def test_stats_report_queues_and_memory_and_every_step_reaches_subscribers():
    runner = ScriptedRunner(bytes_per_token=100)
    engine = make_engine(runner, memory_budget_bytes=1_000_000)
    steps: list[StepStats] = []
    engine.subscribe(steps.append)
    asyncio.run(collect(engine, "r", range(1, 21), max_tokens=5, ignore_eos=True))
    wait_until(lambda: engine.stats().memory.get("kv_cache") == 0)

    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.reserved_cache_bytes) == (0, 0, 0)
    assert stats.num_unprefilled_tokens == 0 and stats.memory_budget_bytes == 1_000_000
    assert len(steps) == 3 + 4 == len(runner.executed_plans)  # 3 prefill chunks, then 4 decodes
    assert [s.num_prefill_tokens for s in steps] == [8, 8, 4, 0, 0, 0, 0]
    assert [s.num_decode_tokens for s in steps] == [0, 0, 0, 1, 1, 1, 1]
    assert sum(s.num_sampled_tokens for s in steps) == 5
    assert all(set(s.step_seconds) == {"schedule", "execute", "postprocess"} for s in steps)
    assert all("other" in s.stage_seconds and not s.failed for s in steps)
    engine.shutdown(timeout=1.0)


def test_engine_loop_runs_without_its_thread():
    runner = ScriptedRunner(scripts={"r": [3, 4]})
    events = []
    loop = EngineLoop(runner, SchedulerConfig(prefill_chunk=4, max_num_seqs=2), lambda rid, ev: events.append(ev))
    loop.submit(Request("r", (1, 2, 3, 4, 5), SamplingParams(max_tokens=2)))
    loop.run_until_idle()
    assert events == [Progress(4, 5), Progress(5, 5), Token(3), Token(4), Done("length", 5, 2)]
    assert runner.released_ids == ["r"]
