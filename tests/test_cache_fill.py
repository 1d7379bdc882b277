"""`bench decode --cache-fill random` (engine/tools/cache_fill.py): a randomly filled cache has, part
for part and layer for layer, the shapes, dtypes, capacities and counters a chunked prefill leaves, so
a decode step on it runs the same kernels on the same sizes; decode runs on it."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.cache_fill import fill_random
from tessera.engine.tools.replay import random_tokens
from tests.support.tiling_model import make_tiling_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_tiling_model(tmp_path_factory.mktemp("fill"), seed=3)
    return load_model(d, dtype="float32", progress=False)


def _shape(a):
    return None if a is None else (tuple(a.shape), a.dtype)


def _layout(cache):
    out = []
    for layer in cache.layers:
        parts = {"window": _shape(layer.window)}
        for name in ("compressed", "index_keys"):
            buf = getattr(layer, name)
            parts[name] = None if buf is None else (buf.num_rows, buf.width, buf.dtype, buf.capacity_nbytes)
        for name in ("compressor", "indexer_compressor"):
            f = getattr(layer, name)
            parts[name] = None if f is None else (f.num_emitted, _shape(f.pending_kv), _shape(f.pending_gate),
                                                  _shape(f.overlap_kv), _shape(f.overlap_gate))
        out.append(parts)
    return out, cache.num_tokens, len(cache.token_ids), cache.nbytes_by_part


def _prefilled(model, ctx, chunk):
    cache = model.new_cache()
    tokens = random_tokens(model.cfg.vocab_size, ctx, seed=0)
    for lo in range(0, ctx, chunk):
        mx.eval(model.forward([Segment(cache, tokens[lo : lo + chunk])], tile=8), cache.arrays())
    return cache


@pytest.mark.parametrize("ctx, chunk", [(3, 32), (70, 32), (263, 32), (600, 64)])
def test_a_random_fill_has_the_shapes_a_chunked_prefill_leaves(model, ctx, chunk):
    filled = fill_random(model.new_cache(), model.cfg, ctx, model.layer_ids, chunk, seed=1)
    assert _layout(filled) == _layout(_prefilled(model, ctx, chunk))


def test_decode_runs_on_a_filled_cache_and_a_stage_fills_only_its_layers(model):
    cache = fill_random(model.new_cache(), model.cfg, 300, range(1, 3), 32)
    assert cache.layers[0].window.shape[0] == 0 and cache.layers[3].compressed.num_rows == 0
    assert cache.layers[1].compressed.num_rows == 75 and cache.layers[2].compressed.num_rows == 9
    full = fill_random(model.new_cache(), model.cfg, 300, model.layer_ids, 32)
    logits = model.forward([Segment(full, [5])])[0]
    assert bool(mx.all(mx.isfinite(logits)).item()) and full.num_tokens == 301
    with pytest.raises(ValueError, match="new cache"):
        fill_random(full, model.cfg, 10, model.layer_ids, 32)


def test_bench_decode_cache_fill_random_cli(model, tmp_path):
    d = make_tiling_model(tmp_path / "m", seed=3)
    cmd = [sys.executable, "-m", "tessera.server.cli", "bench", "decode", "--model", str(d), "--ctx", "5000", "--chunk", "256",
           "--tile", "64", "--steps", "3", "--cache-fill", "random", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["ctx"], r["cache_fill"], len(r["step_ms"])) == (5000, "random", 3)


def test_rewind_puts_a_cache_back_exactly_as_a_failed_step_needs(model):
    """A step that appended rows and then failed is undone by `rewind` (engine/serving/runner.py): the cache
    has its old rows, windows and frontiers, and continues exactly like one that never ran the step."""
    from tessera.engine.model.cache import resume_state, rewind

    cache, twin = _prefilled(model, 70, 32), _prefilled(model, 70, 32)
    before, ids = _layout(cache), list(cache.token_ids)
    state = resume_state(cache)
    mx.eval(model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, 40, seed=1))], tile=8), cache.arrays())
    assert _layout(cache) != before  # 70 -> 110 closed CSA and HCA groups
    rewind(cache, state)
    assert _layout(cache) == before and cache.token_ids == ids
    nxt = random_tokens(model.cfg.vocab_size, 5, seed=2)
    got = model.forward([Segment(cache, nxt)], tile=8, all_logits=True)[0]
    want = model.forward([Segment(twin, nxt)], tile=8, all_logits=True)[0]
    assert mx.array_equal(got, want).item()
