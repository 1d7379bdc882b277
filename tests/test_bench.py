"""The benchmark tools (`tessera bench ...`) and the memory plan against what MLX measures. The numerical
contracts of tiling and chunking are in tests/equivalence/test_tiled_chunked_decode.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tessera.engine.model.loader import load_model
from tessera.engine.tools import bench
from tessera.engine.tools.bench import RunOptions, bench_with_model
from tessera.engine.tools.make_model import make_model
from tests.support.tiling_model import model, model_dir  # noqa: F401 (fixtures)


def test_bench_prefill_cli_reports_how_it_ran(model_dir):
    cmd = [sys.executable, "-m", "tessera.server.cli", "bench", "prefill", "--model", str(model_dir), "--ctx", "256",
           "--chunk", "128", "--tile", "32", "--no-stage-sync", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (report["ctx"], report["chunk"], report["tile"]) == (256, 128, 32)
    assert report["stage_sync"] is False and report["stage_seconds"] == {}
    assert report["prefill_tokens_per_s"] > 0 and report["peak_memory_bytes"] > report["weights_bytes"]


def test_bench_compare_alternates_the_order_of_settings_between_rounds(model, monkeypatch):
    ran = []

    def fake_prefill(model, tokens, chunk, tile, label="", options=None, pipelined=True):
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
    cmd = [sys.executable, "-m", "tessera.server.cli", "bench", "compare", "--model", str(model_dir), "--ctx", "256",
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


def test_a_blocking_setting_reaches_the_tile_loop(model, monkeypatch):
    """`C:T:blocking` must switch pipelining off in attention.py: a pipelined prefill starts every
    tile of every layer with mx.async_eval, a blocking one never does (nor does a stage-synced one).
    A pipelined tile is started only after the previous one was waited for (an mx.eval in between):
    two tiles' scratch never coexist."""
    calls = []
    real_async_eval, real_eval = bench.mx.async_eval, bench.mx.eval
    monkeypatch.setattr(bench.mx, "async_eval", lambda *a: (calls.append("a"), real_async_eval(*a))[1])
    monkeypatch.setattr(bench.mx, "eval", lambda *a: (calls.append("e"), real_eval(*a))[1])

    def tiles_started(setting, stage_sync):
        calls.clear()
        row = bench.bench_interleaved(model, 256, [setting], RunOptions(stage_sync=stage_sync))[0]
        order = "".join(calls)
        assert "aa" not in order, order
        return order.count("a"), row["pipelined_tiles"]

    # warm-up (2 chunks) + one measured run (2 chunks), 4 tiles of 32 rows per chunk, 4 layers
    assert tiles_started(bench.Setting(128, 32), stage_sync=False) == (2 * 2 * 4 * 4, True)
    assert tiles_started(bench.Setting(128, 32, pipelined=False), stage_sync=False) == (0, False)
    assert tiles_started(bench.Setting(128, 32), stage_sync=True) == (0, False)


def test_blocking_and_pipelined_tiles_give_the_same_logits(model):
    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.model.trace import ForwardTrace
    from tessera.engine.tools.replay import random_tokens

    tokens = random_tokens(model.cfg.vocab_size, 200, seed=3)
    logits = []
    for pipelined in (True, False):
        cache, trace = model.new_cache(), ForwardTrace(stage_sync=False, pipeline_tiles=pipelined)
        out = [model.forward([Segment(cache, tokens[lo : lo + 64])], tile=16, all_logits=True, timer=trace)[0]
               for lo in range(0, 200, 64)]
        logits.append(bench.mx.concatenate(out))
    assert bench.mx.array_equal(logits[0], logits[1]).item()


@pytest.mark.parametrize("spec,expected", [("4096:1024", (4096, 1024, True)), ("4096:1024:blocking", (4096, 1024, False))])
def test_compare_settings_parse_the_blocking_suffix(spec, expected):
    from tessera.engine.tools.commands import _setting

    s = _setting(spec)
    assert (s.chunk, s.tile, s.pipelined) == expected


def test_bench_compare_cli_rejects_an_unknown_tile_mode(model_dir):
    cmd = [sys.executable, "-m", "tessera.server.cli", "bench", "compare", "--model", str(model_dir), "--ctx", "256",
           "--settings", "128:32:async"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "expected C:T or C:T:blocking" in out.stderr


def test_pipelined_tiles_hold_one_tiles_scratch_like_blocking_ones(tmp_path_factory):
    """Without stage syncs a tile is the only evaluation point inside a layer: pipelining (tile i+1
    started only after tile i finished) must peak like blocking tiles and within the plan; a tile
    loop that left the tiles to the layer's evaluation would hold every tile's scratch at once."""
    small = load_model(_small_dir(tmp_path_factory), dtype="float32")
    tokens = bench.random_tokens(small.cfg.vocab_size, 1024, seed=0)
    options = RunOptions(stage_sync=False)
    peaks = {p: bench.prefill_once(small, tokens, 512, 128, options=options, pipelined=p)[1] for p in (True, False)}
    plan = bench.make_plan(small.cfg, 1024, 512, 128, "float32").peak_bytes
    assert peaks[True] <= 1.02 * peaks[False], peaks
    assert 0.85 <= peaks[True] / plan <= 1.15, (peaks, plan)
