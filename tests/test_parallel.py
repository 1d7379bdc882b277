"""Pipeline parallel on mx.distributed (ring backend, 127.0.0.1): the layer split, the per-rank loading,
and `tessera check parallel` — a 2-rank replay equals one process in logits and indexer selections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.model.memory_plan import cache_bytes_at, cache_bytes_by_part
from tessera.engine.parallel.layout import split_layers
from tessera.engine.parallel.serving import max_stage_cache_bytes
from tessera.engine.parallel.transport import TRANSPORT_ENV
from tessera.engine.tools.make_model import make_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3, with_tokenizer=False)


def test_split_covers_every_layer_once_in_order():
    assert split_layers(43, 2).ranges == (range(0, 21), range(21, 43))
    assert split_layers(4, 3).ranges == (range(0, 1), range(1, 2), range(2, 4))
    for world in (1, 2, 3, 5):
        layers = [i for r in split_layers(10, world).ranges for i in r]
        assert layers == list(range(10))
    with pytest.raises(ValueError, match="world"):
        split_layers(4, 5)


def test_a_stage_loads_only_its_layers(tiny_dir):
    baseline = mx.get_active_memory()  # arrays other tests left alive count in the peak too
    mx.reset_peak_memory()
    stage = load_model(tiny_dir, layers=range(2, 4), vocab=False)
    stage_peak = mx.get_peak_memory() - baseline  # the other layers are never read: the shards are memory-mapped
    assert {name.split(".")[1] for name in stage.weights} == {"2", "3"}
    assert sorted(stage.layers) == [2, 3]
    whole = load_model(tiny_dir)
    first = load_model(tiny_dir, layers=range(0, 2), vocab=True)
    assert sum(w.nbytes for w in first.weights.values()) + sum(w.nbytes for w in stage.weights.values()) == \
        sum(w.nbytes for w in whole.weights.values())
    assert stage_peak < 0.5 * sum(w.nbytes for w in whole.weights.values())
    with pytest.raises(ValueError, match="layer range"):
        load_model(tiny_dir, layers=range(3, 5))


def test_admission_counts_the_largest_stage_cache_not_the_whole_model(tiny_dir):
    """Each rank holds its layers' caches only, so a request needs per GPU what its largest stage holds."""
    cfg, n = load_model(tiny_dir).cfg, 5000
    whole = cache_bytes_at(cfg, n, 4)
    layout = split_layers(cfg.num_hidden_layers, 2)
    per_rank = [cache_bytes_at(cfg, n, 4, layers) for layers in layout.ranges]
    assert sum(per_rank) == whole
    assert max_stage_cache_bytes(cfg, layout, n, 4) == max(per_rank) < whole


def test_a_stage_cache_holds_what_the_plan_says(tiny_dir):
    """The plan's per-layer-range bytes match a real cache filled by the layers of one range."""
    model = load_model(tiny_dir, dtype="float32")
    cache = model.new_cache()
    model.run_layers(model.embed([Segment(cache, list(range(300)))]), [Segment(cache, list(range(300)))], range(2, 4))
    rows_only = sum(l.nbytes for i, l in enumerate(cache.layers) if i in range(2, 4))
    assert sum(l.nbytes for i, l in enumerate(cache.layers) if i not in range(2, 4)) == 0
    assert rows_only == sum(cache_bytes_by_part(model.cfg, 300, None, 4, range(2, 4)).values())


def _check_parallel(model_dir: Path, *args: str, transport: str | None = None) -> tuple[int, dict]:
    env = dict(os.environ)  # inherits how this process imports tessera (tests/conftest.py)
    env.pop(TRANSPORT_ENV, None)
    if transport is not None:  # forced; by default the ring backend moves streams point to point
        env[TRANSPORT_ENV] = transport
    env.pop("LD_PRELOAD", None)  # exactness: the same (reference) BLAS in every process
    proc = subprocess.run([sys.executable, "-m", "tessera.engine.tools.commands", "check", "parallel", "--model", str(model_dir),
                           *args, "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("transport", ["p2p", "collective"])
@pytest.mark.parametrize("world", [2, 3])
def test_check_parallel_equals_one_process(tiny_dir, world, transport):
    """Both transports (engine/parallel/transport.py): send/recv, and the all_gather hops that NCCL needs."""
    # 100 tokens > ratio 4 × top-k 16: the indexer really chooses; chunk 32 / tile 8: chunked and tiled.
    code, report = _check_parallel(tiny_dir, "--world", str(world), "--tokens", "100", "--chunk", "32",
                                   "--tile", "8", "--decode", "3", transport=transport)
    assert code == 0 and report["passed"], report
    assert report["transport"] == transport
    assert report["max_abs_diff"] == 0.0  # the same arithmetic on the same shapes, only moved between processes
    assert report["differing_selections"] == 0
    assert report["compared_selections"] == 2 * 103  # 2 CSA layers × (100 prompt + 3 decode) positions
    assert report["layers_per_rank"] == [[r.start, r.stop] for r in split_layers(4, world).ranges]
    # every rank holds only its part of the weights
    assert sum(report["weights_bytes_per_rank"]) == report["single_process_weights_bytes"]
    assert max(report["weights_bytes_per_rank"]) < report["single_process_weights_bytes"]


@pytest.mark.parametrize("world, transport", [(2, "p2p"), (3, "collective")])
def test_overlapped_prefill_equals_one_process(tiny_dir, world, transport):
    """--overlap: prefill chunks before the last are not sent back, so rank 0 runs ahead; caches, the last
    chunk's logits, the decode logits and every selection stay one process's exactly."""
    code, report = _check_parallel(tiny_dir, "--world", str(world), "--tokens", "100", "--chunk", "32",
                                   "--tile", "8", "--decode", "3", "--overlap", transport=transport)
    assert code == 0 and report["passed"], report
    assert report["overlap"] and report["transport"] == transport
    assert report["max_abs_diff"] == 0.0 and report["differing_selections"] == 0
    assert report["compared_logit_rows"] == (100 - 96) + 3  # the last chunk (96..99) and 3 decode steps
    assert report["compared_selections"] == 2 * 103  # every prompt position's selections came from the ranks


def test_check_parallel_fails_past_its_threshold(tiny_dir):
    """Exact runs pass at 1e-5; a negative limit cannot be met, so the verdict must say so (exit 1)."""
    code, report = _check_parallel(tiny_dir, "--tokens", "20", "--chunk", "8", "--tile", "4", "--decode", "1",
                                   "--max-abs-diff", "-1")
    assert code == 1 and not report["passed"] and "max |Δlogit|" in report["failures"][0]


@pytest.mark.parametrize("args, message", [
    (["--tile", "8"], "--tile (8)"),
    (["--tile", "2", "--world", "1"], "--world (1)"),
    (["--tile", "2", "--world", "5"], "world (5) must be between 1 and the model's 4 layers"),
])
def test_check_parallel_rejects_bad_arguments(tiny_dir, args, message):
    env = dict(os.environ)  # inherits how this process imports tessera (tests/conftest.py)
    proc = subprocess.run([sys.executable, "-m", "tessera.engine.tools.commands", "check", "parallel", "--model", str(tiny_dir),
                           "--tokens", "10", "--chunk", "4", *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
