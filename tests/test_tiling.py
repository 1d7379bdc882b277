"""The tiled indexer is exact (DESIGN.md §3): for every (chunk C, tile T) the selected rows are the
same and the float32 logits bit-identical; resumed prefill equals one prefill; prefill + decode
equals the whole-sequence forward; the memory plan matches what MLX measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from engine.model.attention import PROJECTION_ROWS
from engine.tools import bench
from engine.tools.bench import RunOptions, bench_with_model
from engine.model.config import CSA, HCA, WINDOW
from engine.tools.consistency import check_model_consistency, differing
from engine.tools.replay import run_sequence
from engine.model.loader import load_model
from engine.tools.make_model import make_model
from engine.model.deepseek_v4 import Segment
from engine.tools.replay import random_tokens
from engine.model.trace import ForwardTrace

# top-k 16 of up to ~100 visible rows; HCA ratio 32 so a 400-token run crosses 12 of its
# boundaries and 100 of the ratio-4 ones; window 16.
OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
CTX = 403
# A chunk longer than one projection block, so tiles straddle the blocks' boundaries.
CHUNK = PROJECTION_ROWS + 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiling"), "tiny", seed=11, with_tokenizer=False, **OVERRIDES)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def tokens(model):
    return random_tokens(model.cfg.vocab_size, CTX + 70, seed=4)


@pytest.fixture(scope="module")
def untiled(model, tokens):
    return run_sequence(model, tokens, CTX, CHUNK, CHUNK)


@pytest.mark.parametrize("tile", [CHUNK, 64, 96, 7, 1], ids=["T=C", "T|C", "T∤C", "T=7", "T=1"])
def test_tiles_select_the_same_rows_and_give_bit_identical_logits(model, tokens, untiled, tile):
    tiled = run_sequence(model, tokens, CTX, CHUNK, tile)
    num_diff, num_compared = differing(tiled.selections, untiled.selections)
    assert num_compared == 2 * (CTX + 70)  # two CSA layers, every position
    assert num_diff == 0
    assert np.array_equal(tiled.logits, untiled.logits)


def test_selections_cover_contexts_below_and_above_topk(untiled, model):
    sizes = {len(rows) for rows in untiled.selections.values()}
    assert 0 in sizes and model.cfg.index_topk in sizes and any(0 < s < model.cfg.index_topk for s in sizes)


def _without_openblas() -> dict:
    """OpenBLAS's gemm result for a row depends on the other rows (measured: docs/BENCHMARKS.md), so
    chunk-size equivalence is bit-exact only with a row-invariant BLAS such as MLX's bundled one."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("chunk,tile", [(64, 64), (50, 16), (37, 1)])
def test_check_consistency_cli_is_exact_with_row_invariant_blas(model_dir, chunk, tile):
    cmd = [sys.executable, "-m", "server.cli", "check", "consistency", "--model", str(model_dir), "--ctx", "301",
           "--decode", "64", "--chunk", str(chunk), "--tile", str(tile), "--json"]
    out = subprocess.run(cmd, env=_without_openblas(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["differing_selections"] == 0 and report["compared_selections"] > 64
    assert report["max_abs_diff"] == 0.0


def test_bench_prefill_cli_reports_how_it_ran(model_dir):
    cmd = [sys.executable, "-m", "server.cli", "bench", "prefill", "--model", str(model_dir), "--ctx", "256",
           "--chunk", "128", "--tile", "32", "--no-stage-sync", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (report["ctx"], report["chunk"], report["tile"]) == (256, 128, 32)
    assert report["stage_sync"] is False and report["stage_seconds"] == {}
    assert report["prefill_tokens_per_s"] > 0 and report["peak_memory_bytes"] > report["weights_bytes"]


def test_bench_compare_alternates_the_order_of_settings_between_rounds(model, monkeypatch):
    ran = []

    def fake_prefill(model, tokens, chunk, tile, label="", options=None):
        ran.append(((chunk, tile), len(tokens)))
        return float(len(ran)), 1000 * len(ran), {}

    monkeypatch.setattr(bench, "prefill_once", fake_prefill)
    rows = bench.bench_interleaved(model, 512, [bench.Setting(128, 128), bench.Setting(128, 32)], RunOptions(repeat=3))
    a, b = (128, 128), (128, 32)
    # Warm-ups of two chunks each, then rounds A B, B A, A B over the whole context.
    assert ran == [(a, 256), (b, 256)] + [(s, 512) for s in (a, b, b, a, a, b)]
    assert rows[0]["run_seconds"] == [3.0, 6.0, 7.0] and rows[1]["run_seconds"] == [4.0, 5.0, 8.0]
    assert rows[0]["prefill_seconds"] == pytest.approx(16 / 3) and rows[1]["peak_memory_bytes"] == 8000


def test_bench_matrix_writes_the_five_rows(model_dir, tmp_path):
    table = bench.bench_matrix(model_dir, ctx=96, dtype="float32", out_dir=tmp_path, options=RunOptions(repeat=2))
    rows = json.loads((tmp_path / "bench-matrix-ctx96.json").read_text())
    assert [(r["chunk"], r["tile"]) for r in rows] == list(bench.MATRIX)
    assert all(len(r["run_seconds"]) == 2 and r["prefill_tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "bench-matrix-ctx96.md").read_text().strip() == table
    assert len(table.splitlines()) == 2 + len(bench.MATRIX)


def test_bench_compare_cli_rejects_a_malformed_setting(model_dir):
    cmd = [sys.executable, "-m", "server.cli", "bench", "compare", "--model", str(model_dir), "--ctx", "256",
           "--settings", "128:128", "128:256"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "setting '128:256': the tile must be between 1 and the chunk" in out.stderr


@pytest.mark.parametrize("split", [1, 2, 3, 4, 5, 127, 128, 129, 200])
def test_resumed_prefill_split_anywhere_equals_one_prefill(model, tokens, split):
    """Splits inside a ratio-4 group, on and around HCA boundaries: same rows, same logits
    (to float32 rounding: the two runs' projections are gemms of different heights)."""
    whole = run_sequence(model, tokens[:CTX], CTX, CTX, 32)
    cache = model.new_cache()
    model.forward([Segment(cache, tokens[:split])], tile=32)
    rest = np.array(model.forward([Segment(cache, tokens[split:CTX])], tile=32, all_logits=True)[0])
    assert np.abs(rest - whole.logits[split:]).max() <= 1e-5


def test_prefill_then_decode_equals_whole_sequence_forward(model):
    report = check_model_consistency(model, ctx=150, decode=64, chunk=64, tile=16, seed=2)
    assert report.differing_selections == 0
    assert report.whole_sequence_max_abs_diff <= 1e-5 and report.untiled_max_abs_diff == 0.0


@pytest.mark.parametrize("chunk,tile", [(512, 512), (256, 256), (128, 128), (512, 256), (512, 128)])
def test_measured_peak_within_15_percent_of_plan(tmp_path_factory, chunk, tile):
    small = load_model(_small_dir(tmp_path_factory), dtype="float32")
    result = bench_with_model(small, ctx=4096, chunk=chunk, tile=tile)
    assert 0.85 <= result["peak_vs_plan"] <= 1.15, result


_SMALL = {}


def _small_dir(factory):
    if "dir" not in _SMALL:
        _SMALL["dir"] = make_model(factory.mktemp("small"), "small", seed=0, with_tokenizer=False, layers=4)
    return _SMALL["dir"]


def test_without_stage_syncs_the_logits_are_the_same_and_no_stage_times_are_claimed(model, tokens):
    synced = run_sequence(model, tokens[:200], 200, 64, 16)
    cache = model.new_cache()
    trace = ForwardTrace(stage_sync=False)
    pieces = [tokens[lo : min(lo + 64, 200)] for lo in range(0, 200, 64)]
    logits = [model.forward([Segment(cache, p)], tile=16, all_logits=True, timer=trace)[0] for p in pieces]
    assert np.array_equal(np.array(mx.concatenate(logits)), synced.logits[:200])
    assert trace.as_dict() == {}
