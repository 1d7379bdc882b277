"""The benchmark tools (`tessera bench ...`) and the memory plan against what MLX measures. The numerical
contracts of tiling and chunking are in tests/equivalence/test_tiled_chunked_decode.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.model.loader import load_model
from engine.tools import bench
from engine.tools.bench import RunOptions, bench_with_model
from engine.tools.make_model import make_model
from tests.support.tiling_model import make_tiling_model

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiling_model(tmp_path_factory.mktemp("tiling"))


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype="float32")


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


# (512, 200): tiles that cover attention blocks only in part pay for zero-padded block copies.
@pytest.mark.parametrize("chunk,tile", [(512, 512), (256, 256), (128, 128), (512, 256), (512, 128), (512, 200)])
def test_measured_peak_within_15_percent_of_plan(tmp_path_factory, chunk, tile):
    small = load_model(_small_dir(tmp_path_factory), dtype="float32")
    result = bench_with_model(small, ctx=4096, chunk=chunk, tile=tile)
    assert 0.85 <= result["peak_vs_plan"] <= 1.15, result


_SMALL = {}


def _small_dir(factory):
    if "dir" not in _SMALL:
        _SMALL["dir"] = make_model(factory.mktemp("small"), "small", seed=0, with_tokenizer=False, layers=4)
    return _SMALL["dir"]


