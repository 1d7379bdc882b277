"""A decode step takes the index arrays an earlier step made for the same host values (kernels/host_arrays.py):
in the steady state a step makes a handful, whatever the batch, instead of one per compressor, layer and
kernel call. On CUDA each new one of more than 8 bytes can cost the host a managed allocation and a
synchronous copy (docs/ARCHITECTURE.md "Host-made arrays")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tessera.kernels import host_arrays
from tests.support.array_recording import recording_array_class
from tests.support.bench_script import ROOT, TINY_OVERRIDES

# Arrays made from host values per steady decode step, 8 steps of sequences at 130 … 133 tokens (so some
# sequence closes a CSA window every step): 5.75 at batch 4 and 6.0 at batch 12 on the CPU's path, each one
# new values: the step's token ids and positions, the CSA layers' row counts, the closing CSA windows'
# positions, the HCA compressor's open slots (its ratio, 32, repeats them only every 32 steps) and the
# stacked gather's offsets. With the compressor's slots or the row counts made anew each time: 8 to 10.
MAX_MADE_PER_STEP = 6


def test_the_same_values_give_the_same_array():
    a = host_array_of([3, 1, 2])
    assert host_array_of([3, 1, 2]) is a
    assert np.array_equal(np.array(a), [3, 1, 2]) and a.dtype == mx.int32
    assert host_array_of([3, 1, 4]) is not a
    assert host_arrays.host_array([3, 1, 2], mx.int64) is not a  # dtype is part of the key
    assert host_arrays.host_array(np.array([[3, 1, 2]])) is not a  # so is the shape
    mask = host_arrays.host_array(np.array([True, False]), mx.bool_)
    assert mask.dtype == mx.bool_ and np.array(mask).tolist() == [True, False]


def test_the_cache_keeps_the_most_recently_used():
    cache = host_arrays.HostArrays(max_entries=2)  # its own: other tests' threads may use the shared one
    first, second = cache.get([101]), cache.get([102])
    assert cache.get([101]) is first  # used again: now the most recent
    cache.get([103])  # evicts [102], the least recently used
    assert cache.get([101]) is first
    assert cache.get([102]) is not second
    assert cache.stats() == host_arrays.HostArrayStats(hits=2, made=4)


def host_array_of(values):
    return host_arrays.host_array(values)


@pytest.mark.parametrize("batch", [4, 12])
def test_a_steady_decode_step_makes_few_arrays_from_host_values(tmp_path, monkeypatch, batch):
    model = load_model(make_model(tmp_path / "m", "tiny", seed=2, with_tokenizer=False, **TINY_OVERRIDES), dtype="float32")
    caches = []
    for b in range(batch):
        cache = model.new_cache()
        model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, 130 + b % 4, b))], tile=16)
        caches.append(cache)

    def steps(first_token: int) -> None:
        for s in range(8):  # two CSA windows: every open-slot pattern of the batch seen once
            mx.eval(model.forward([Segment(c, [first_token + s]) for c in caches]), [c.arrays() for c in caches])

    steps(2)
    made = _count_arrays_made(monkeypatch)
    before = host_arrays.stats()
    steps(10)
    hits = host_arrays.stats().hits - before.hits
    assert hits > 0  # the step asks for its index arrays through the cache: the bound below is not vacuous
    assert len(made) / 8 <= MAX_MADE_PER_STEP, (len(made) / 8, [a.shape for a in made])


def _count_arrays_made(monkeypatch) -> list[mx.array]:
    """From now on every `mx.array(...)` anyone calls is recorded (tests/support/array_recording.py)."""
    made: list[mx.array] = []
    monkeypatch.setattr(mx, "array", recording_array_class(made))
    return made


def test_the_cost_probe_times_both_arms_of_every_size_in_alternating_rounds(tmp_path):
    out = tmp_path / "cost.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds its checkout itself
    done = subprocess.run([sys.executable, str(ROOT / "docs/bench/host_array_cost.py"), str(out), "--sizes", "2", "16",
                           "--reps", "3", "--rounds", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    timed = [(r["values"], r["arm"]) for r in rows if r["what"] == "host_array"]
    assert timed == [(n, arm) for n in (2, 16) for arm in ("fresh", "cached", "cached", "fresh")]
    assert all(r["make_us_median"] > 0 and r["use_us_median"] > 0 for r in rows if r["what"] == "host_array")
    # fresh: a new array every rep; cached: the one array made for those values
    assert [r["new_arrays"] for r in rows if r["what"] == "host_array"] == [2, 0, 0, 2] * 2  # of 3 reps: 2 follow one
    summaries = [r for r in rows if r["what"] == "summary"]
    assert [(r["values"], r["nbytes"]) for r in summaries] == [(2, 8), (16, 64)]
    assert all(r["fresh_make_us"] > 0 and r["cached_make_us"] > 0 for r in summaries)


def test_switched_off_every_call_makes_a_new_array_of_the_same_values(monkeypatch):
    from tests.support.env_switch import switch_in_fresh_process

    assert switch_in_fresh_process("TESSERA_HOST_ARRAY_CACHE", None, "tessera.kernels.host_arrays", "cache_enabled") == "True"
    monkeypatch.setattr(host_arrays, "_switch", host_arrays.Switch("TESSERA_HOST_ARRAY_CACHE", default=False))
    first = host_array_of([7, 8])
    assert host_array_of([7, 8]) is not first and np.array(host_array_of([7, 8])).tolist() == [7, 8]


def test_the_per_step_probe_counts_both_settings_at_both_batch_sizes(tmp_path):
    """docs/bench/host_arrays_per_step.py, by path on the tiny model: the CUDA path stood in on the CPU."""
    from tests.support.bench_script import run_bench_script, tiny_model

    rows = run_bench_script("host_arrays_per_step.py", tiny_model(tmp_path / "model"), tmp_path / "per_step.jsonl",
                            "--ctx", "100", "--batch", "3", "--steps", "4", "--warm-steps", "8")
    counted = [r for r in rows if r["what"] == "host_arrays"]
    assert [(r["host_array_cache"], r["batch"]) for r in counted] == [(False, 1), (False, 3), (True, 1), (True, 3)]
    assert all(r["per_step"] >= r["over_8_bytes_per_step"] >= 0 for r in counted)
    assert all(r["cuda_kernels_per_step"] > 0 for r in counted)  # the CUDA path's kernels ran (stood in)
    off, on = counted[1], counted[3]  # batch 3: the cache takes most of them
    assert on["per_step"] < off["per_step"] and off["over_8_bytes_per_step"] > 0
