"""The real model behind the engine loop: a request abandoned mid-prefill or mid-decode (what the
server does when a client disconnects) gives its cache back — MLX active memory returns to idle —
and greedy decoding through the engine equals the model's own greedy continuation."""

from __future__ import annotations

import asyncio
import time

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.serving.engine_loop import AsyncEngine
from tessera.engine.tools.make_model import make_model
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.serving.protocol import Progress, SamplingParams, Token
from tessera.engine.serving.runner import build_runner
from tessera.engine.serving.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model_dir = make_model(tmp_path_factory.mktemp("mem"), "tiny", seed=9, with_tokenizer=False)
    return build_runner(model_dir, prefill_chunk=64, indexer_tile=16)


def _engine(runner) -> AsyncEngine:
    engine = AsyncEngine(runner, SchedulerConfig(prefill_chunk=64, max_num_seqs=4, max_model_len=4096))
    engine.start()
    return engine


def _idle_memory() -> int:
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


async def _leave_after(engine: AsyncEngine, request_id: str, prompt: list[int], event_type: type) -> None:
    stream = engine.generate(request_id, prompt, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    async for event in stream:
        if isinstance(event, event_type):
            break
    await stream.aclose()  # the client went away


def _wait_idle(engine: AsyncEngine, runner, timeout_s: float = 30.0) -> None:
    # The release rides on the engine's next plan: the published stats can say idle a moment before
    # the runner has dropped the cache, so wait for the runner's own count too.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if not (stats.num_running or stats.num_waiting or stats.memory.get("kv_cache") or runner.memory_snapshot()["kv_cache"]):
            return
        time.sleep(0.01)


@pytest.mark.parametrize("when", [Progress, Token], ids=["mid-prefill", "mid-decode"])
def test_abandoned_request_returns_memory_to_idle(runner, when):
    engine = _engine(runner)
    try:
        idle = _idle_memory()
        prompt = np.random.default_rng(0).integers(0, 2048, 600).tolist()
        asyncio.run(_leave_after(engine, "leaver", prompt, when))
        _wait_idle(engine, runner)
        assert engine.stats().num_running == 0
        assert runner.memory_snapshot()["kv_cache"] == 0
        # the engine thread may still drop its last step's arrays: memory must get back to idle soon
        deadline = time.monotonic() + 10.0
        while _idle_memory() > idle + 64 * 1024 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _idle_memory() <= idle + 64 * 1024  # a few small buffers at most, never a cache
    finally:
        engine.shutdown(10)


def test_engine_greedy_equals_model_greedy(runner):
    prompt = np.random.default_rng(1).integers(0, 2048, 150).tolist()
    engine = _engine(runner)

    async def collect() -> list[int]:
        stream = engine.generate("g", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        return [e.token_id async for e in stream if isinstance(e, Token)]

    try:
        served = asyncio.run(collect())
    finally:
        engine.shutdown(10)
    model, cache = runner.model, runner.model.new_cache()
    logits = model.forward([Segment(cache, prompt)])[0]
    direct = []
    for _ in range(12):
        direct.append(int(mx.argmax(logits[0]).item()))
        logits = model.forward([Segment(cache, [direct[-1]])])[0]
    assert served == direct


def test_one_prefill_step_in_the_interval_times_its_stages_and_sampling_is_unchanged(runner):
    from tessera.engine.serving.protocol import DecodeSlot, PrefillChunk, StepPlan

    prompt = list(range(1, 50))
    runner.stage_timing_interval, runner._prefill_steps = 2, 0
    outputs = []
    for i in range(3):
        runner.add_request(f"s{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4))
        outputs.append(runner.execute(StepPlan(prefill=PrefillChunk(f"s{i}", tuple(prompt), start=0, is_last=True))))
    decode = runner.execute(StepPlan(decodes=(DecodeSlot("s0", outputs[0].sampled[0].token_id, position=len(prompt)),)))
    for i in range(3):
        runner.release(f"s{i}")
    runner.stage_timing_interval = 1
    timed = {"indexer_score", "topk", "attention", "moe", "other"}
    assert [set(o.stage_seconds) for o in outputs] == [timed, set(), timed]
    assert decode.stage_seconds == {}
    assert len({o.sampled[0].token_id for o in outputs}) == 1  # timed or not, the same greedy token
