"""The metric contract of server/metrics.py: on the Metrics object itself, and end to end through the real
server (one HTTP request in, GET /metrics scraped and parsed around it).

What a dashboard relies on: which series exist with which labels, and by how much each moves around a request.
The real-Prometheus check of the dashboard's queries is tests/test_prometheus_scrape.py.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tessera.engine.serving.engine_loop import AsyncEngine
from tests.support.fake_runner import ScriptedRunner
from tessera.engine.serving.protocol import (
    OVERLAP_EVENTS, Done, EngineStats, Error, Progress, RequestTimings, SamplingParams, StepStats, Token,
)
from tessera.engine.serving.scheduler import SchedulerConfig
from tessera.server.metrics import (
    INTER_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, VLLM_ALIASES, Metrics,
    build_1_2_5_buckets, metrics_router,
)
from server_harness import MODEL_NAME, live_server

MODEL = "tiny-v4"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "OBSERVABILITY.md"


def value(metrics: Metrics, name: str, **labels: str) -> float:
    """A sample's value (0 when the series does not exist yet), with model_name filled in."""
    found = metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    return 0.0 if found is None else found


def families(metrics: Metrics) -> dict[str, object]:
    return {family.name: family for family in metrics.registry.collect()}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tracked(metrics: Metrics, num_prompt_tokens: int) -> tuple:
    from tessera.server.metrics import RequestTracker

    clock = FakeClock()
    return RequestTracker(metrics, num_prompt_tokens, clock), clock


# ---- around one request ------------------------------------------------------------------------------------


def test_a_request_moves_each_series_by_the_right_amount():
    metrics = Metrics(MODEL)
    tracker, clock = tracked(metrics, num_prompt_tokens=12)

    clock.now += 0.5
    tracker.on_event(Progress(8, 12))
    tracker.on_event(Progress(12, 12))
    tracker.on_event(Token(7))  # first token at +0.5 s
    clock.now += 0.1
    tracker.on_event(Token(8))
    clock.now += 0.2
    tracker.on_event(Token(9))
    timings = RequestTimings(queue_seconds=0.25, prefill_seconds=0.25, decode_seconds=0.3, e2e_seconds=0.8)
    tracker.on_event(Done("length", 12, 3, timings))

    assert value(metrics, "tessera_time_to_first_token_seconds_count") == 1
    assert value(metrics, "tessera_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "tessera_inter_token_latency_seconds_count") == 2
    assert value(metrics, "tessera_inter_token_latency_seconds_sum") == pytest.approx(0.3)
    assert value(metrics, "tessera_request_success_total", finished_reason="length") == 1
    assert value(metrics, "tessera_request_success_total", finished_reason="stop") == 0
    assert value(metrics, "tessera_e2e_request_latency_seconds_sum") == pytest.approx(0.8)
    assert value(metrics, "tessera_request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value(metrics, "tessera_request_prefill_time_seconds_sum") == pytest.approx(0.25)
    assert value(metrics, "tessera_request_decode_time_seconds_sum") == pytest.approx(0.3)
    assert value(metrics, "tessera_request_inference_time_seconds_sum") == pytest.approx(0.55)
    assert value(metrics, "tessera_request_time_per_output_token_seconds_sum") == pytest.approx(0.15)  # 0.3 / 2
    assert value(metrics, "tessera_request_prompt_tokens_sum") == 12
    assert value(metrics, "tessera_request_generation_tokens_sum") == 3
    # A histogram's buckets are cumulative: 0.5 s lands in le=0.5 and every bucket above it.
    assert value(metrics, "tessera_time_to_first_token_seconds_bucket", le="0.25") == 0
    assert value(metrics, "tessera_time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(metrics, "tessera_time_to_first_token_seconds_bucket", le="+Inf") == 1


def test_an_unstreamed_stop_token_counts_as_arriving_with_done():
    metrics = Metrics(MODEL)
    tracker, clock = tracked(metrics, num_prompt_tokens=4)
    clock.now += 1.0
    tracker.on_event(Done("stop", 4, 1, RequestTimings(0.5, 0.5, 0.0, 1.0)))  # EOS was the first token

    assert value(metrics, "tessera_time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(metrics, "tessera_inter_token_latency_seconds_count") == 0
    assert value(metrics, "tessera_request_generation_tokens_sum") == 1
    assert value(metrics, "tessera_request_time_per_output_token_seconds_count") == 0  # needs two tokens


def test_a_request_the_server_ends_is_counted_once_with_the_reason_the_client_saw():
    metrics = Metrics(MODEL)
    tracker, clock = tracked(metrics, num_prompt_tokens=4)
    tracker.on_event(Token(1))
    clock.now += 2.0
    tracker.on_closed("stop")  # a stop string matched; the engine request was aborted
    tracker.on_closed("abort")  # the response then closed: already counted
    tracker.on_event(Done("abort", 4, 1, RequestTimings(0.1, 0.1, 2.0, 2.2)))

    assert value(metrics, "tessera_request_success_total", finished_reason="stop") == 1
    assert value(metrics, "tessera_request_success_total", finished_reason="abort") == 0
    assert value(metrics, "tessera_e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert value(metrics, "tessera_request_decode_time_seconds_sum") == pytest.approx(2.0)
    assert value(metrics, "tessera_request_queue_time_seconds_count") == 0  # the split is unknown: not guessed


def test_errors_and_rejections():
    metrics = Metrics(MODEL)
    failed, _ = tracked(metrics, num_prompt_tokens=4)
    failed.on_event(Error("runner crashed"))
    refused, _ = tracked(metrics, num_prompt_tokens=4)
    refused.on_rejected("queue_full")

    assert value(metrics, "tessera_request_success_total", finished_reason="error") == 1
    assert value(metrics, "tessera_admission_rejections_total", reason="queue_full") == 1
    assert value(metrics, "tessera_admission_rejections_total", reason="too_long") == 0
    assert value(metrics, "tessera_e2e_request_latency_seconds_count") == 1  # the refused one never started


def step(num_prefill: int, num_decode: int, num_sampled: int, stages: dict, failed: bool = False,
         overlap: tuple[str, ...] = ()) -> StepStats:
    seconds = {"schedule": 0.0, "execute": 1.0, "postprocess": 0.0}
    return StepStats(num_prefill, num_decode, num_sampled, stages, seconds, failed, overlap_events=overlap)


def test_decode_overlap_events_count_by_event_and_exist_at_zero():
    metrics = Metrics(MODEL)
    assert {e: value(metrics, "tessera_decode_overlap_steps_total", event=e) for e in OVERLAP_EVENTS} == dict.fromkeys(
        OVERLAP_EVENTS, 0)
    metrics.observe_step(step(num_prefill=0, num_decode=2, num_sampled=2, stages={}, overlap=("queued",)))
    metrics.observe_step(step(num_prefill=0, num_decode=2, num_sampled=2, stages={}, overlap=("taken", "queued")))
    metrics.observe_step(step(num_prefill=5, num_decode=2, num_sampled=2, stages={}, overlap=("undone",)))
    assert value(metrics, "tessera_decode_overlap_steps_total", event="queued") == 2
    assert value(metrics, "tessera_decode_overlap_steps_total", event="taken") == 1
    assert value(metrics, "tessera_decode_overlap_steps_total", event="undone") == 1
    assert value(metrics, "tessera_decode_overlap_steps_total", event="failed") == 0


def test_a_step_moves_token_counters_and_stage_histograms():
    metrics = Metrics(MODEL)
    stages = {"indexer_score": 0.2, "topk": 0.05, "attention": 0.5, "moe": 1.5, "other": 0.01}
    metrics.observe_step(step(num_prefill=6, num_decode=1, num_sampled=2, stages=stages))
    metrics.observe_step(step(num_prefill=0, num_decode=1, num_sampled=1, stages={"moe": 9}))
    metrics.observe_step(step(num_prefill=4, num_decode=0, num_sampled=0, stages={}, failed=True))  # ran nothing

    assert value(metrics, "tessera_prompt_tokens_total") == 6
    assert value(metrics, "tessera_generation_tokens_total") == 3
    assert value(metrics, "tessera_iteration_tokens_count") == 2
    assert value(metrics, "tessera_iteration_tokens_sum") == 7 + 1
    assert value(metrics, "tessera_prefill_stage_seconds_sum", stage="moe") == pytest.approx(1.5)  # decode-only: no
    assert value(metrics, "tessera_prefill_stage_seconds_count", stage="attention") == 1


# ---- the engine end to end ---------------------------------------------------------------------------------


async def _run_request(engine: AsyncEngine, metrics: Metrics, request_id: str, prompt: list[int], **sampling):
    tracker = metrics.track(len(prompt))
    async for event in engine.generate(request_id, prompt, SamplingParams(**sampling)):
        tracker.on_event(event)


def test_counters_match_the_engine_over_concurrent_requests():
    metrics = Metrics(MODEL)
    runner = ScriptedRunner()
    engine = AsyncEngine(runner, SchedulerConfig(prefill_chunk=8, max_num_seqs=3))
    engine.subscribe(metrics.observe_step)
    engine.start()
    prompts = {f"r{i}": list(range(1, 6 + 4 * i)) for i in range(5)}

    async def main():
        runs = (_run_request(engine, metrics, rid, p, max_tokens=4, ignore_eos=True) for rid, p in prompts.items())
        await asyncio.wait_for(asyncio.gather(*runs), 10)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown(1.0)
    plans = runner.executed_plans
    assert value(metrics, "tessera_prompt_tokens_total") == sum(map(len, prompts.values()))
    assert value(metrics, "tessera_generation_tokens_total") == 4 * len(prompts)
    assert value(metrics, "tessera_iteration_tokens_count") == len(plans)
    assert value(metrics, "tessera_iteration_tokens_sum") == sum(plan.num_tokens for plan in plans)
    assert value(metrics, "tessera_request_success_total", finished_reason="length") == len(prompts)
    assert value(metrics, "tessera_time_to_first_token_seconds_count") == len(prompts)
    assert value(metrics, "tessera_inter_token_latency_seconds_count") == 3 * len(prompts)
    assert value(metrics, "tessera_prefill_stage_seconds_count", stage="other") == sum(
        plan.prefill is not None for plan in plans
    )


def test_memory_and_prefill_gauges_move_while_a_long_request_runs_and_return_after():
    metrics = Metrics(MODEL, memory_budget_bytes=10**9)
    runner = ScriptedRunner(step_delay_s=0.01, bytes_per_token=1000)
    config = SchedulerConfig(prefill_chunk=16, max_num_seqs=2, memory_budget_bytes=10**6)
    engine = AsyncEngine(runner, config)
    engine.subscribe(metrics.observe_step)
    engine.start()
    seen = {"kv_cache": 0.0, "in_flight": 0.0, "running": 0.0, "kv_usage": 0.0}

    async def main():
        task = asyncio.ensure_future(_run_request(engine, metrics, "long", list(range(1, 200)), max_tokens=20))
        while not task.done():
            metrics.observe_engine(engine.stats())
            seen["kv_cache"] = max(seen["kv_cache"], value(metrics, "tessera_memory_bytes", kind="kv_cache"))
            seen["in_flight"] = max(seen["in_flight"], value(metrics, "tessera_prefill_tokens_in_flight"))
            seen["running"] = max(seen["running"], value(metrics, "tessera_num_requests_running"))
            seen["kv_usage"] = max(seen["kv_usage"], value(metrics, "tessera_kv_cache_usage_perc"))
            await asyncio.sleep(0.005)
        await task

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
        deadline = time.monotonic() + 5  # the cache is released, then snapshotted, on the engine's next turn
        while engine.stats().memory.get("kv_cache") != 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        metrics.observe_engine(engine.stats())
    finally:
        engine.shutdown(1.0)

    assert seen["kv_cache"] > 16 * 1000
    assert 0 < seen["in_flight"] <= 199
    assert seen["running"] == 1
    assert seen["kv_usage"] == pytest.approx(219 * 1000 / 10**6)  # reserved at prompt + max_tokens
    assert value(metrics, "tessera_memory_bytes", kind="kv_cache") == 0
    assert value(metrics, "tessera_prefill_tokens_in_flight") == 0
    assert value(metrics, "tessera_num_requests_running") == 0
    assert value(metrics, "tessera_kv_cache_usage_perc") == 0
    assert value(metrics, "tessera_memory_bytes", kind="budget") == 10**9


# ---- through the real server: one HTTP request, GET /metrics around it ------------------------------------

Scrape = dict  # LiveServer.scrape(): {(sample name, labels): value}


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    """How much one served sample moved between two scrapes (a sample absent before counts from 0)."""
    key = (name, frozenset({"model_name": MODEL_NAME, **labels}.items()))
    assert key in after, f"{name}{labels} is not served at /metrics"
    return after[key] - before.get(key, 0.0)


def test_one_http_request_moves_the_served_series_by_exactly_its_tokens(tokenizer):
    """The server's own wiring (routes -> RequestTracker, engine steps -> Metrics.observe_step) counts a request
    once."""
    with live_server(tokenizer) as server:
        script = server.text_tokens("the answer is forty two")  # ends with EOS: finish_reason "stop"
        server.runner.script("metrics contract", script)
        before = server.scrape()
        reply = server.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "metrics contract"}], max_tokens=64)
        after = server.scrape()

    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(script)  # the EOS is generated, though never sent
    assert moved(before, after, "tessera_prompt_tokens_total") == reply.usage.prompt_tokens
    assert moved(before, after, "tessera_generation_tokens_total") == len(script)
    assert moved(before, after, "tessera_request_success_total", finished_reason="stop") == 1
    for reason in ("length", "abort", "error"):
        assert moved(before, after, "tessera_request_success_total", finished_reason=reason) == 0
    assert moved(before, after, "tessera_time_to_first_token_seconds_count") == 1
    assert moved(before, after, "tessera_e2e_request_latency_seconds_count") == 1
    assert moved(before, after, "tessera_inter_token_latency_seconds_count") == len(script) - 1
    assert moved(before, after, "tessera_request_prompt_tokens_sum") == reply.usage.prompt_tokens
    assert moved(before, after, "tessera_request_generation_tokens_sum") == len(script)
    assert moved(before, after, "tessera_iteration_tokens_sum") == reply.usage.prompt_tokens + len(script) - 1


def test_over_http_a_stop_string_finishes_once_and_a_refusal_is_only_a_rejection(tokenizer):
    # ScriptedRunner caches 1 KiB per token: a 64 KiB budget holds 64 tokens at most.
    with live_server(tokenizer, memory_budget_bytes=64 * 1024) as server:
        server.runner.script("cut me", server.text_tokens("one two three four"))
        client = server.client()
        before = server.scrape()
        cut = client.completions.create(model=MODEL_NAME, prompt="cut me", max_tokens=20, stop="thr")
        with pytest.raises(openai.BadRequestError):  # its cache at prompt + max_tokens can never fit
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=100)
        server.wait_until_idle()
        after = server.scrape()

    assert cut.choices[0].finish_reason == "stop"
    assert moved(before, after, "tessera_request_success_total", finished_reason="stop") == 1  # as the client saw
    assert moved(before, after, "tessera_request_success_total", finished_reason="abort") == 0  # not again
    assert moved(before, after, "tessera_admission_rejections_total", reason="never_fits") == 1
    assert moved(before, after, "tessera_e2e_request_latency_seconds_count") == 1  # the refused one never started
    idle = {"tessera_kv_cache_usage_perc": {}, "tessera_memory_bytes": {"kind": "kv_cache"},
            "tessera_num_requests_running": {}, "tessera_prefill_tokens_in_flight": {}}
    for name, labels in idle.items():  # all released: the gauges are back at 0 at the next scrape
        assert after[(name, frozenset({"model_name": MODEL_NAME, **labels}.items()))] == 0, name


# ---- series, labels and names as documented ----------------------------------------------------------------


def test_memory_kinds_are_set_and_reset():
    metrics = Metrics(MODEL)
    metrics.set_memory({"weights": 100, "kv_cache": 50, "mlx_active": 70}, budget_bytes=1000)
    assert value(metrics, "tessera_memory_bytes", kind="kv_cache") == 50
    assert value(metrics, "tessera_memory_bytes", kind="budget") == 1000
    assert value(metrics, "tessera_memory_bytes", kind="process_peak_rss") > 0

    metrics.set_memory({"weights": 100, "kv_cache": 0}, budget_bytes=None)
    assert value(metrics, "tessera_memory_bytes", kind="kv_cache") == 0
    kinds = {s.labels["kind"] for s in families(metrics)["tessera_memory_bytes"].samples}
    assert "mlx_active" not in kinds and "budget" not in kinds  # gone, not stale


def test_every_series_carries_model_name_and_the_documented_labels():
    metrics = Metrics(MODEL, {"prefill_chunk": 4096, "api_keys": [], "model": None}, vllm_aliases=True)
    metrics.set_tiling(4096, 1024)
    metrics.set_memory({"weights": 1}, budget_bytes=2)
    metrics.observe_step(step(num_prefill=1, num_decode=0, num_sampled=0, stages={"moe": 0.1}))
    expected_labels = {
        "tessera_request_success": {"model_name", "finished_reason"},
        "tessera_admission_rejections": {"model_name", "reason"},
        "tessera_http_errors": {"model_name", "status"},
        "tessera_memory_bytes": {"model_name", "kind"},
        "tessera_prefill_stage_seconds": {"model_name", "stage"},
        "tessera_decode_overlap_steps": {"model_name", "event"},
        "tessera_config": {"model_name", "prefill_chunk", "api_keys", "model"},
    }
    for name, family in families(metrics).items():
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            assert labels == expected_labels.get(name.replace("vllm:", "tessera_"), {"model_name"}), sample
            assert sample.labels["model_name"] == MODEL
    info = families(metrics)["tessera_config"].samples[0]
    assert info.name == "tessera_config_info" and info.labels["model"] == "" and info.labels["api_keys"] == "[]"


def test_names_follow_prometheus_conventions():
    metrics = Metrics(MODEL, {}, vllm_aliases=False)
    for family in metrics.registry.collect():
        assert family.name.startswith("tessera_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.type == "histogram" and not family.name.endswith("_tokens"):
            assert family.name.endswith("_seconds"), family.name  # durations in base units


def test_buckets_keep_vllms_boundaries_and_reach_an_hour():
    vllm_ttft = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0}
    vllm_request = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0}
    assert vllm_ttft <= set(TTFT_BUCKETS) and max(TTFT_BUCKETS) >= 3600
    assert vllm_request <= set(REQUEST_LATENCY_BUCKETS) and 3600 in REQUEST_LATENCY_BUCKETS
    assert INTER_TOKEN_BUCKETS[0] == 0.01 and INTER_TOKEN_BUCKETS[-1] == 80.0
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(1_048_576)[-1] == 1_000_000


def test_vllm_aliases_exist_only_with_the_flag_and_equal_their_source():
    plain, aliased = Metrics(MODEL), Metrics(MODEL, vllm_aliases=True)
    for metrics in (plain, aliased):
        metrics.observe_engine(_stats(num_running=3, num_waiting=2, reserved=250, budget=1000))
        tracker, clock = tracked(metrics, num_prompt_tokens=5)
        clock.now += 0.3
        tracker.on_event(Token(1))
        tracker.on_event(Done("stop", 5, 1, RequestTimings(0.1, 0.2, 0.0, 0.3)))

    assert not [f for f in plain.registry.collect() if f.name.startswith("vllm:")]
    names = {f.name for f in aliased.registry.collect()}
    assert {alias for aliases in VLLM_ALIASES.values() for alias in aliases} <= names
    assert value(aliased, "vllm:num_requests_running") == 3
    assert value(aliased, "vllm:num_requests_waiting") == 2
    assert value(aliased, "vllm:kv_cache_usage_perc") == 0.25
    assert value(aliased, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(aliased, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(aliased, "vllm:iteration_tokens_total_count") == value(aliased, "tessera_iteration_tokens_count")
    for source, aliases in VLLM_ALIASES.items():
        for alias in aliases:
            assert _values(aliased, alias) == _values(aliased, source)


def _values(metrics: Metrics, family_name: str) -> list[tuple]:
    family = next(f for f in metrics.registry.collect() if f.name == family_name)
    stem = len(family_name)
    return sorted((s.name[stem:], tuple(sorted(s.labels.items())), s.value)
                  for s in family.samples if not s.name.endswith("_created"))


def _stats(num_running: int, num_waiting: int, reserved: int, budget: int | None) -> EngineStats:
    return EngineStats(
        num_running=num_running, num_waiting=num_waiting, num_unprefilled_tokens=0, reserved_cache_bytes=reserved,
        memory_budget_bytes=budget, memory={"kv_cache": reserved}, is_alive=True, is_accepting=True,
    )


def test_the_route_serves_fresh_engine_gauges():
    metrics = Metrics(MODEL, vllm_aliases=True)
    current = {"stats": None}
    app = FastAPI()
    app.include_router(metrics_router(metrics, lambda: current["stats"]))
    client = TestClient(app)

    loading = client.get("/metrics")  # no engine yet: still a valid scrape
    current["stats"] = _stats(num_running=4, num_waiting=0, reserved=0, budget=None)
    serving = client.get("/metrics")
    openmetrics = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})

    assert loading.status_code == 200 and serving.status_code == 200
    assert serving.headers["content-type"].startswith("text/plain")
    assert f'tessera_num_requests_running{{model_name="{MODEL}"}} 4.0' in serving.text
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 4.0' in serving.text
    # Text 0.0.4 even when OpenMetrics is preferred: its encoder would rewrite `vllm:` to `vllm_`.
    assert openmetrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 4.0' in openmetrics.text


def test_the_docs_list_every_metric():
    documented = set(re.findall(r"`((?:tessera_|vllm:)[a-z0-9_:]+)", DOCS.read_text()))
    metrics = Metrics(MODEL, {}, vllm_aliases=True)
    metrics.set_tiling(1, 1)
    for family in metrics.registry.collect():
        sample_names = {s.name for s in family.samples if not s.name.endswith("_created")}
        exposed = {family.name} | sample_names if family.type in ("counter", "info") else {family.name}
        assert exposed & documented, f"{family.name} is not in docs/OBSERVABILITY.md"
