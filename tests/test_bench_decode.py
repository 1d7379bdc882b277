"""`tessera bench decode`: the report a user reads (step times, tokens/s, the bytes floor and the
per-stage split) and the byte accounting behind the floor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tessera.engine.model.loader import load_model
from tessera.engine.tools.bench_decode import cache_bytes_read, expected_experts, weights_bytes_touched
from tests.support.tiling_model import make_tiling_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiling_model(tmp_path_factory.mktemp("decode"), seed=3)


def _bench(model_dir, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tessera.server.cli", "bench", "decode", "--model", str(model_dir), "--ctx", "70",
           "--chunk", "32", "--tile", "8", "--steps", "4", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_bench_decode_cli_reports_steps_against_the_bytes_floor(model_dir):
    out = _bench(model_dir, "--batch", "3", "--stage-sync", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["ctx"], r["batch"], r["steps"], len(r["step_ms"])) == (70, 3, 4, 4)
    assert min(r["step_ms"]) <= r["step_ms_median"] <= r["step_ms_p90"] <= max(r["step_ms"])
    # tokens/s is the sustained rate: the batch's tokens over the mean step, the slower steps (a CSA window
    # closing every fourth token) counted; the median is the typical step the floor comparison reads
    assert r["step_ms_mean"] == pytest.approx(sum(r["step_ms"]) / 4)
    assert r["decode_tokens_per_s"] == pytest.approx(3 * 1000 * 4 / sum(r["step_ms"]))
    assert r["bytes_read_per_step"] == r["weights_bytes_per_step"] + r["cache_bytes_per_step"] > 0
    assert r["floor_ms"] == pytest.approx(r["bytes_read_per_step"] / r["copy_bandwidth_bytes_per_s"] * 1000)
    assert r["vs_floor"] == pytest.approx(r["step_ms_median"] / r["floor_ms"])
    assert set(r["stage_ms"]) == {"attention", "indexer", "moe", "other"}
    assert all(v > 0 for v in r["stage_ms"].values())
    assert sum(r["stage_ms"].values()) <= sum(r["step_ms"]) / 4  # the stages are parts of the step


def test_bench_decode_without_stage_sync_claims_no_split(model_dir):
    out = _bench(model_dir, "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["batch"] == 1 and r["stage_ms"] == {} and r["stage_sync"] is False


def test_bench_decode_splits_a_step_into_the_hosts_build_and_encode_and_the_wait(model_dir):
    """Whether a step is host-bound: Python's build, MLX's encode, then the wait for the ids (the device's rest)."""
    r = json.loads(_bench(model_dir, "--json").stdout.strip().splitlines()[-1])
    split = r["host_split_ms"]
    assert set(split) == {"build", "encode", "wait"} and split["build"] > 0 and min(split.values()) >= 0
    assert sum(split.values()) <= max(r["step_ms"]) * 1.01  # medians of the parts of the same steps
    synced = json.loads(_bench(model_dir, "--stage-sync", "--json").stdout.strip().splitlines()[-1])
    served = json.loads(_bench(model_dir, "--decode-overlap", "on", "--json").stdout.strip().splitlines()[-1])
    assert "host_split_ms" not in synced and "host_split_ms" not in served  # evaluates while building / the runner's step


@pytest.mark.parametrize("flag,expected", [("off", False), ("on", True)])
def test_bench_decode_compile_switch_is_honoured_and_reported(model_dir, flag, expected):
    out = _bench(model_dir, "--compile", flag, "--steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["compile"] is expected


@pytest.mark.parametrize("flag,expected", [("off", False), ("on", True)])
def test_bench_decode_step_compile_switch_is_honoured_and_reported(model_dir, flag, expected):
    """--compile-step sets TESSERA_COMPILE_STEP's switch for the run; the report says which ran, and
    gives the warm-up steps' times (the first one traces the compiled parts when it is on)."""
    out = _bench(model_dir, "--compile-step", flag, "--steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["compile_step"] is expected
    assert len(r["warmup_step_ms"]) == 3 and all(ms > 0 for ms in r["warmup_step_ms"])


@pytest.mark.parametrize("flag", ["on", "off"])
def test_bench_decode_times_the_serving_step_with_the_overlap_on_or_off(model_dir, flag):
    """--decode-overlap times ModelRunner.execute of decode plans; the report says so, and what the overlap
    did: with it on, every step after the first was queued ahead and taken."""
    out = _bench(model_dir, "--batch", "2", "--decode-overlap", flag, "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["path"], r["decode_overlap"], len(r["step_ms"]), len(r["warmup_step_ms"])) == ("runner", flag == "on", 4, 3)
    counts = r["decode_overlap_counts"]
    assert counts == ({"queued": 7, "taken": 6, "undone": 1, "failed": 0} if flag == "on" else
                      {"queued": 0, "taken": 0, "undone": 0, "failed": 0})


@pytest.mark.parametrize("bad,message", [(["--batch", "0"], "positive integer"),
                                         (["--tile", "64"], "--tile (64) must be at most --chunk (32)"),
                                         (["--decode-overlap", "on", "--stage-sync"], "cannot be combined")])
def test_bench_decode_rejects_bad_arguments(model_dir, bad, message):
    out = _bench(model_dir, *bad)
    assert out.returncode == 2
    assert bad[0] in out.stderr and message in out.stderr


def test_cache_bytes_count_window_index_keys_selected_and_hca_rows(model_dir):
    cfg = load_model(model_dir, dtype="float32").cfg  # window 16, top-k 16, head 32, index head 32
    n = 200  # CSA: 50 compressed rows (top-k reads 16 of them), HCA (ratio 32): 6 rows
    window = 16 * 32
    csa = 50 * 32 + 16 * 32
    hca = 6 * 32
    assert cache_bytes_read(cfg, n, 4) == 4 * (4 * window + 2 * csa + hca)
    assert cache_bytes_read(cfg, 10, 4) == 4 * (4 * 10 * 32 + 2 * (2 * 32 + 2 * 32))  # short: all rows


def test_weights_touched_grow_with_the_experts_a_batch_uses(model_dir):
    model = load_model(model_dir, dtype="float32")
    cfg = model.cfg
    assert expected_experts(cfg, 1) == pytest.approx(cfg.num_experts_per_tok)
    assert expected_experts(cfg, 64) == pytest.approx(cfg.n_routed_experts, rel=1e-6)
    all_weights = sum(w.nbytes for w in model.weights.values())
    one, many = weights_bytes_touched(model, 1), weights_bytes_touched(model, 64)
    assert one < many < all_weights  # 64 tokens use every expert but not every embedding row


@pytest.mark.parametrize("stage_sync", [True, False])
def test_bench_decode_warms_up_with_the_steps_it_measures(model_dir, stage_sync, monkeypatch):
    """A stage-synced step runs its parts plain: warming up with unsynced steps left their first-use compilation
    in the first measured step (32 s of a batch-16 run on the H200). Warm-up and measured steps sync alike."""
    from tessera.engine.tools import bench_decode

    seen: list[bool] = []
    real = bench_decode._decode_step
    monkeypatch.setattr(bench_decode, "_decode_step", lambda model, caches, ids, timer: seen.append(timer.stage_sync)
                        or real(model, caches, ids, timer))
    options = bench_decode.DecodeOptions(chunk=32, tile=8, steps=2, warmup=2, stage_sync=stage_sync)
    report = bench_decode.bench_decode(load_model(model_dir), 40, 1, options)
    assert seen == [stage_sync] * 4 and len(report["warmup_step_ms"]) == 2
