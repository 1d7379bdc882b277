"""Prefix cache (engine/serving/prefix_cache.py): a turn restored from the cache equals the same
request without it, bit for bit; prefixes are keyed by their whole history; the scheduler starts a
request where its cached prefix ends; the cache stays inside its bytes under many distinct prefixes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.engine.model.loader import load_model
from tessera.engine.serving.prefix_blocks import BLOCK_TOKENS, aligned_chunk_end, chained_keys, root_key
from tessera.engine.serving.protocol import SamplingParams
from tessera.engine.serving.request import Request
from tessera.engine.serving.scheduler import Scheduler, SchedulerConfig
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.prefix_check import Engine
from tessera.engine.tools.replay import random_tokens
from tests.equivalence.row_invariant_blas import row_invariant_blas
from tests.server_harness import real_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prefix"), "tiny", seed=3, with_tokenizer=False)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype="float32")


def _without_openblas() -> dict:
    """Chunk-size equivalence is bit-exact only with a row-invariant BLAS (tests/test_tiling.py)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return env


def test_a_restored_turn_is_bit_identical_to_the_same_request_without_the_cache(model_dir):
    cmd = [sys.executable, "-m", "tessera.engine.tools.commands", "check", "prefix-cache", "--model", str(model_dir),
           "--fill", "96:32", "--reuse", "64:7", "--json"]
    out = subprocess.run(cmd, env=_without_openblas(), capture_output=True, text=True, timeout=600)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    cases = {c["name"]: c for c in report["cases"]}
    assert all(c["identical"] for c in report["cases"]), report
    assert out.returncode == 0, out.stderr
    # Turn 1 (300 prompt tokens + 39 decoded) saved 128 and 256; the next turn (385 tokens, off a block)
    # restores 256 and saves 384, which the seeded repeat and the concurrent pair then restore.
    assert cases["next turn, greedy [a]"]["num_cached_tokens"] == 256
    assert cases["next turn, seeded [a]"]["num_cached_tokens"] == 384
    assert cases["diverges on a block boundary, greedy [a]"]["num_cached_tokens"] == 256
    assert cases["two requests share one prefix [a]"]["num_cached_tokens"] == 384
    assert cases["two requests share one prefix [b]"]["num_cached_tokens"] == 256


def test_a_block_key_names_the_whole_prefix_and_the_model():
    tokens = list(range(3 * BLOCK_TOKENS))
    changed = [7] + tokens[1:]  # only the first token differs
    root = root_key("model-a|float32")
    a, b = chained_keys(tokens, root, 0, len(tokens)), chained_keys(changed, root, 0, len(tokens))
    assert all(x != y for x, y in zip(a, b))  # a later block's key depends on every earlier token
    assert chained_keys(tokens, root_key("model-a|bfloat16"), 0, BLOCK_TOKENS) != a[:1]
    assert chained_keys(tokens, a[0], BLOCK_TOKENS, 3 * BLOCK_TOKENS) == a[1:]  # resuming a chain gives the same keys


@pytest.mark.parametrize(
    "start,end,prompt_end,expected",
    [
        (0, 300, 1000, 256),  # stops inside the prompt: back to a block
        (0, 100, 1000, 100),  # no block inside the chunk: as scheduled
        (256, 1000, 1000, 896),  # reaches the prompt's end: stop at its last block first
        (896, 1000, 1000, 1000),  # the tail after the last block
        (0, 1024, 1024, 1024),  # the prompt ends on a block
    ],
)
def test_prefill_chunks_end_on_blocks(start, end, prompt_end, expected):
    assert aligned_chunk_end(start, end, prompt_end) == expected


class _Matcher:
    def __init__(self, num_cached: int) -> None:
        self.num_cached, self.asked = num_cached, []

    def __call__(self, request_id, prompt_ids) -> int:
        self.asked.append(request_id)
        return self.num_cached


def test_the_scheduler_starts_a_request_where_its_cached_prefix_ends():
    matcher = _Matcher(256)
    config = SchedulerConfig(prefill_chunk=300, prefix_cache_bytes=1000)
    scheduler = Scheduler(config, lambda n: n, prefix_match=matcher)
    request = Request("r", list(range(700)), SamplingParams(max_tokens=4))
    scheduler.add(request)
    starts = []
    while not request.is_prefill_done:
        plan = scheduler.schedule()
        starts.append((plan.prefill.start, plan.prefill.start + len(plan.prefill.token_ids)))
        request.num_computed_tokens += len(plan.prefill.token_ids)
    assert starts == [(256, 512), (512, 640), (640, 700)]
    assert matcher.asked == ["r"] and request.num_cached_tokens == 256


def test_without_a_prefix_cache_the_scheduler_neither_asks_nor_aligns():
    matcher = _Matcher(256)
    scheduler = Scheduler(SchedulerConfig(prefill_chunk=300), lambda n: n, prefix_match=matcher)
    scheduler.add(Request("r", list(range(700)), SamplingParams(max_tokens=4)))
    plan = scheduler.schedule()
    assert (plan.prefill.start, len(plan.prefill.token_ids)) == (0, 300) and matcher.asked == []


def test_admission_counts_the_prefix_cache_inside_the_budget():
    config = SchedulerConfig(prefill_chunk=64, memory_budget_bytes=1000, prefix_cache_bytes=400)
    scheduler = Scheduler(config, lambda n: n * 10)
    scheduler.add(Request("a", list(range(50)), SamplingParams(max_tokens=10)))  # 600 bytes: fits in 1000 - 400
    scheduler.add(Request("b", list(range(5)), SamplingParams(max_tokens=1)))  # 60 more: would fit 1000, not 600
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        SchedulerConfig(memory_budget_bytes=1000, prefix_cache_bytes=1000)


def test_many_distinct_long_prefixes_never_exceed_the_cache_bytes(model):
    capacity = 400_000  # a few 384-token prefixes of the tiny model
    engine = Engine(model, 128, 32, prefix_cache_bytes=capacity)
    cache = engine.runner.prefix_cache
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompts = [random_tokens(model.cfg.vocab_size, 400, seed) for seed in range(8)]
    peak = 0
    for i, prompt in enumerate(prompts):
        engine.run({f"p{i}": prompt}, greedy)
        peak = max(peak, cache.nbytes)
        assert engine.runner.memory_snapshot()["prefix_cache"] == cache.nbytes <= capacity
    assert cache.stats().num_evicted_nodes > 0 and peak > capacity // 2
    # LRU: the newest prefix is still there, the oldest was evicted.
    newest = engine.run({"again-newest": prompts[-1] + [1]}, greedy)["again-newest"]
    oldest = engine.run({"again-oldest": prompts[0] + [1]}, greedy)["again-oldest"]
    assert newest.num_cached_tokens == 384 and oldest.num_cached_tokens == 0


# ---- over HTTP: `tessera serve`'s wiring (settings -> engine factory -> app -> /metrics) ----------------------


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prefix-served"), "tiny", seed=5, with_tokenizer=True)


@contextmanager
def _served(model_dir, **settings):
    from tessera.server.settings import Settings

    app_settings = Settings(model=model_dir, prefill_chunk=96, indexer_tile=32, metrics_vllm_aliases=True, **settings)
    with real_server(app_settings) as (base_url, served):
        yield base_url, served.info.name


def _complete(base_url: str, model: str, prompt: list[int]) -> tuple[list[str], list[float], int]:
    """-> the tokens, their logprobs, and usage.prompt_tokens_details.cached_tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).json()
    logprobs = reply["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _metric(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


@row_invariant_blas
def test_a_second_turn_over_http_hits_the_cache_and_answers_as_without_it(served_dir):
    first = random_tokens(2048, 300, seed=21)
    second = first + random_tokens(2048, 50, seed=22)
    with _served(served_dir, prefix_cache=False) as (url, model):
        expected = _complete(url, model, second)
        assert _metric(url, "tessera_prefix_cache_queries_total") == 0
    with _served(served_dir, prefix_cache_bytes="64MiB") as (url, model):
        _complete(url, model, first)
        got = _complete(url, model, second)
        assert _metric(url, "tessera_prefix_cache_queries_total") == 350 + 300
        assert _metric(url, "tessera_prefix_cache_hits_total") == 256  # turn 1 saved its last block boundary
        assert _metric(url, "vllm:prefix_cache_hits_total") == 256
        assert 0 < _metric(url, "tessera_memory_bytes", kind="prefix_cache") <= 64 * 2**20
    assert got[:2] == expected[:2]  # same tokens, bit-identical logprobs
    assert (got[2], expected[2]) == (256, 0)  # usage tells the client what the cache saved


def test_bench_multiturn_reports_both_arms_in_alternating_order(model):
    from tessera.engine.tools.bench_multiturn import bench_multiturn_with_model

    result = bench_multiturn_with_model(model, ctx=700, new=100, reply=40, chunk=256, tile=64, rounds=2)
    # Turn 1: 560 prompt tokens (saved at 512), a 40-token reply (its decode passes no block: 599 < 640).
    assert result["cached_tokens"] == 512 and result["turn2_tokens"] == 700
    assert [r["cached_tokens"] for r in result["runs"]["cached"]] == [512, 512]
    assert [r["cached_tokens"] for r in result["runs"]["cold"]] == [0, 0]
    assert result["same_first_token"] and result["ratio"] == result["cached_ttft_s"] / result["cold_ttft_s"]


@pytest.mark.parametrize(
    "enabled,requested,budget,expected",
    [(False, None, None, 0), (True, None, None, 4 * 2**30), (True, None, 1000, 250), (True, 100, 1000, 100)],
)
def test_prefix_cache_bytes_come_out_of_the_budget(enabled, requested, budget, expected):
    from tessera.engine.serving.factory import EngineOptions, prefix_cache_bytes

    options = EngineOptions(None, 64, 64, None, 0, 4, 4, budget, prefix_cache=enabled, prefix_cache_bytes=requested)
    assert prefix_cache_bytes(options, budget) == expected


def test_a_prefix_cache_as_large_as_the_budget_is_refused_naming_the_setting():
    from tessera.engine.serving.factory import EngineOptions, prefix_cache_bytes

    options = EngineOptions(None, 64, 64, None, 0, 4, 4, 2000, prefix_cache=True, prefix_cache_bytes=1000)
    with pytest.raises(ValueError, match="prefix_cache_bytes .* --prefix-cache-bytes"):
        prefix_cache_bytes(options, 1000)


@row_invariant_blas
def test_a_sequence_whose_saved_prefix_was_evicted_saves_from_the_start_and_restores_exactly(model):
    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.serving.prefix_cache import Lineage, PrefixCache
    from tessera.engine.tools.replay import run_sequence

    tokens = random_tokens(model.cfg.vocab_size, 520, seed=31)
    cache_a, lineage = model.new_cache(), Lineage()
    prefix_cache = PrefixCache(model.cfg, model.dtype, capacity_bytes=10**9)
    model.forward([Segment(cache_a, tokens[:256])], tile=32)
    prefix_cache.save(cache_a, lineage)
    first = lineage.node
    prefix_cache.capacity_bytes = 0
    prefix_cache._evict_to(0)  # everything goes, as under pressure from other prefixes
    assert not first.is_alive and prefix_cache.nbytes == 0 and first.rows == ()
    prefix_cache.capacity_bytes = 10**9
    model.forward([Segment(cache_a, tokens[256:384])], tile=32)
    prefix_cache.save(cache_a, lineage)
    assert lineage.node.parent is None and lineage.node.num_tokens == 384  # rows [0, 384) in one node

    node = prefix_cache.longest_prefix(tokens[:500])
    restored = prefix_cache.restore(node, tokens)
    rest = model.forward([Segment(restored, tokens[384:500])], tile=16, all_logits=True)[0]
    cold = run_sequence(model, tokens[:500], 500, 500, 16)
    assert (np.array(rest) == cold.logits[384:]).all()


@row_invariant_blas
def test_replay_through_the_cache_equals_the_cold_replay_row_for_row(model):
    """Model level (engine/tools/replay.py): turn 1 (prompt + decode) fills the cache under chunk 96 / tile 32;
    turn 2 (turn 1 + new tokens) restores 384 tokens, where turn 1's decode crossed a block, and its rows
    equal a cold run's under chunk 64 / tile 7."""
    from tessera.engine.serving.prefix_cache import PrefixCache
    from tessera.engine.tools.replay import run_sequence, run_with_prefix_cache

    tokens = random_tokens(model.cfg.vocab_size, 560, seed=41)
    prefix_cache = PrefixCache(model.cfg, model.dtype, capacity_bytes=10**9)
    turn1 = run_with_prefix_cache(model, prefix_cache, tokens[:400], 330, 96, 32)
    assert turn1.num_cached == 0 and prefix_cache.stats().num_nodes == 3  # 128, 256 (prefill), 384 (decode)
    turn2 = run_with_prefix_cache(model, prefix_cache, tokens, 520, 64, 7)
    cold = run_sequence(model, tokens, 520, 64, 7)
    assert turn2.num_cached == 384
    assert (turn2.logits == cold.logits[384:]).all()


@pytest.mark.parametrize("new,reply", [(50, 0), (0, 10), (60, 40), (90, 20)])
def test_bench_multiturn_refuses_arguments_that_leave_turn_1_no_prompt(tmp_path, capsys, new, reply):
    from tessera.engine.tools.commands import main

    argv = ["bench", "multiturn", "--model", str(tmp_path), "--ctx", "100", "--new", str(new), "--reply", str(reply)]
    assert main(argv) == 2  # before any model is loaded: tmp_path holds none
    assert "--new and --reply must be positive" in capsys.readouterr().err
