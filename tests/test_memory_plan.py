"""The memory plan at V4 Flash scale reproduces the seed's untiled figures and shows what tiling
changes; admission's cache bound covers what a real cache holds."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model
from tessera.engine.model.memory_plan import cache_bytes_at, cache_bytes_by_part, plan_for
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.tools.replay import random_tokens

GiB = 2**30


@pytest.mark.parametrize("chunk,expected_gib", [(4096, 12.0), (2048, 6.0), (1024, 3.0)])
def test_untiled_indexer_scratch_matches_the_seed_table(chunk, expected_gib):
    plan = plan_for(None, "v4-flash", 1048576, chunk, chunk, None)
    scores_mask_topk = sum(b.nbytes for b in plan.indexer if b.name in ("indexer_scores", "indexer_mask", "topk_scratch"))
    assert scores_mask_topk == expected_gib * GiB


def test_tiling_bounds_the_scratch_by_the_tile_not_the_chunk():
    tiled = plan_for(None, "v4-flash", 1048576, 4096, 1024, None)
    small_chunk = plan_for(None, "v4-flash", 1048576, 1024, 1024, None)
    assert tiled.indexer_bytes == small_chunk.indexer_bytes
    assert tiled.attention_bytes == small_chunk.attention_bytes
    assert tiled.chunk_bytes == 4 * small_chunk.chunk_bytes


def test_plan_cli_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tessera.engine.tools.commands", "plan", "--preset", "v4-flash", "--ctx", "1048576",
                          "--chunk", "4096", "--tile", "1024", "--json"], capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert plan["tile"] == 1024 and plan["peak_bytes"] > plan["weights_bytes"] > 0


def test_planned_cache_parts_equal_the_real_cache_and_admission_covers_it(tmp_path):
    model = load_model(make_model(tmp_path / "m", "tiny", seed=0, with_tokenizer=False))
    cache = model.new_cache()
    model.forward([Segment(cache, random_tokens(2048, 777, 0))])  # 777: open groups in both compressors
    assert cache.nbytes_by_part == cache_bytes_by_part(model.cfg, 777, None, 4)
    assert cache.nbytes <= cache_bytes_at(model.cfg, 777, 4)


def test_after_a_prefill_memory_holds_weights_and_cache_only(tmp_path):
    """Nothing chunk-scaled outlives the forward pass: what a sequence keeps between steps (window,
    compressor frontier) is a few rows cut out of chunk-wide arrays, copied out (cache.owned)."""
    model = load_model(make_model(tmp_path / "m", "tiny", seed=0, with_tokenizer=False))
    mx.eval(model.weights)
    before = _idle_active_memory()  # other tests' arrays may live in this process too
    cache = model.new_cache()
    tokens = random_tokens(2048, 1538, 0)  # open groups in both compressors after each chunk
    for lo in range(0, len(tokens), 512):
        logits = model.forward([Segment(cache, tokens[lo : lo + 512])], tile=128)
        mx.eval(logits, cache.arrays())
    del logits
    grown = _idle_active_memory() - before
    assert grown <= _capacity_bytes(cache) + 16 * 1024  # slack: a few small scalars and index arrays


def _idle_active_memory() -> int:
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


def _capacity_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        total += layer.window.nbytes
        for buf in (layer.compressed, layer.index_keys):
            total += buf.capacity_nbytes if buf is not None else 0
        for frontier in (layer.compressor, layer.indexer_compressor):
            total += frontier.nbytes if frontier is not None else 0
    return total


def test_gpu_limits_count_one_attention_block_not_the_tile():
    """Attention runs on 128-row blocks whatever the tile: at 1M context with V4 Flash's attention
    shapes tile 4096 is fine (one block's logits: 128 × 64 × 8,321), and a context whose single
    block would pass 2³¹ elements is refused by naming max_context, even at tile 1."""
    from tessera.engine.tools.make_model import preset_config
    from tessera.engine.serving.runner import gpu_limit_errors

    cfg = preset_config("flash-attn")
    assert gpu_limit_errors(cfg, 4096, 1024, 1048576) == []
    assert gpu_limit_errors(cfg, 4096, 4096, 1048576) == []
    for tile in (1, 128):  # HCA at 2²⁵ tokens: 262,144 compressed rows + window + sink
        (problem,) = gpu_limit_errors(cfg, 4096, tile, 2**25)
        assert "max_context (33554432)" in problem and "2,148,540,416" in problem


def test_gpu_limits_still_refuse_tile_wide_arrays_and_long_chunks():
    from tessera.engine.tools.make_model import preset_config
    from tessera.engine.serving.runner import gpu_limit_errors

    cfg = preset_config("flash-attn")
    (problem,) = gpu_limit_errors(cfg, 8192, 8192, 1048576)  # gathered rows: 8192 × (128 + 512) × 512
    assert "indexer_tile (8192)" in problem and "2,684,354,560" in problem
    assert "prefill_chunk (70000)" in gpu_limit_errors(cfg, 70000, 1024, 65536)[0]


def test_attention_plan_counts_the_blocks_a_tile_touches_and_their_padding():
    """A tile's attention runs on the 128-row blocks it touches, all in one graph: an aligned tile
    plans exactly its rows, an unaligned one the whole blocks it reaches plus zero-padded copies."""
    from tessera.engine.model.memory_plan import blocks_per_tile

    assert blocks_per_tile(4096, 1024) == (8, 0)
    assert blocks_per_tile(3001, 3001) == (24, 0)  # one tile: blocks cut at the segment's end, no padding
    assert blocks_per_tile(512, 200) == (3, 440)  # rows 200..400: copies of 128 + 128 beside 72 + 112 zeros
    aligned = {b.name: b.nbytes for b in plan_for(None, "v4-flash", 1048576, 4096, 1024, None).attention}
    unaligned = {b.name: b.nbytes for b in plan_for(None, "v4-flash", 1048576, 4096, 1000, None).attention}
    assert aligned["attention_logits"] == 1024 * 64 * 8321 * 4 and aligned["padded_blocks"] == 0
    assert unaligned["attention_logits"] == 9 * 128 * 64 * 8321 * 4 and unaligned["padded_blocks"] > 0


# ---- weights formats and the fit verdict (issue 13) --------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_official_weights_count_quantized_bytes_like_the_loader(tmp_path, dtype):
    """The plan's official-format bytes equal what the loader actually holds for that checkpoint, at either compute
    dtype (norm weights and the router held in float32 whatever it is)."""
    from tessera.engine.model.dtypes import DTYPES
    from tessera.engine.model.quantized import QuantizedWeight
    from tessera.engine.model.weight_formats import format_weights_bytes

    model = load_model(make_model(tmp_path / "m", "tiny", seed=0, with_tokenizer=False, fmt="official"), dtype=dtype)
    held = sum(w.nbytes for w in model.weights.values())
    assert any(isinstance(w, QuantizedWeight) for w in model.weights.values())
    assert format_weights_bytes(model.cfg, "official", DTYPES[dtype].size) == held


def test_v4_flash_formats_order_and_size():
    plans = {w: plan_for(None, "v4-flash", 1048576, 4096, 1024, None, w) for w in ("official", "affine8", "bfloat16")}
    official = plans["official"].weights_bytes
    assert 140 * GiB < official < 150 * GiB  # the release is ~149 GiB on disk with its MTP layer
    assert official < plans["affine8"].weights_bytes < plans["bfloat16"].weights_bytes
    assert 520 * GiB < plans["bfloat16"].weights_bytes < 540 * GiB


@pytest.mark.parametrize("budget,fits,status", [("139GiB", False, 1), ("180GiB", True, 0)])
def test_plan_cli_says_whether_it_fits(budget, fits, status):
    out = subprocess.run([sys.executable, "-m", "tessera.engine.tools.commands", "plan", "--preset", "v4-flash", "--ctx", "1048576",
                          "--chunk", "4096", "--tile", "1024", "--weights", "official", "--memory-budget", budget, "--json"],
                         capture_output=True, text=True)
    plan = json.loads(out.stdout)
    assert out.returncode == status and plan["fits"] is fits
    assert plan["peak_bytes"] == plan["weights_bytes"] + plan["cache_bytes"] + plan["workspace_bytes"]


def test_plan_cli_rejects_a_bad_budget():
    out = subprocess.run([sys.executable, "-m", "tessera.engine.tools.commands", "plan", "--preset", "v4-flash", "--ctx", "4096",
                          "--chunk", "4096", "--memory-budget", "lots"], capture_output=True, text=True)
    assert out.returncode == 2 and "--memory-budget 'lots'" in out.stderr


def test_plan_counts_a_layers_dequantized_projections_for_quantized_prefill(tmp_path):
    """Steps of >= dense_min_rows() rows compute on a transient dequantized copy of a layer's quantized
    projections (engine/model/quantized.py): the plan counts it — the loader's own quantized set —
    for a quantized model only, and only when the chunk reaches that many rows."""
    from tessera.engine.model.quantized import QuantizedWeight, dense_min_rows
    from tessera.engine.serving.runner import ModelRunner

    d = make_model(tmp_path / "official", "tiny", seed=1, with_tokenizer=False, fmt="official")
    model = load_model(d, dtype="float32")
    per_layer = [sum(w.dequantize().nbytes for name, w in model.weights.items() if isinstance(w, QuantizedWeight)
                     and name.startswith(f"layers.{i}.") and ".experts." not in name)
                 for i in range(model.cfg.num_hidden_layers)]
    plan = plan_for(d, None, 4096, dense_min_rows(), 64, "float32", weights_format="official")
    assert [b.nbytes for b in plan.chunk_activations if b.name == "dequantized_weights"] == [max(per_layer)]
    short = plan_for(d, None, 4096, dense_min_rows() - 1, 64, "float32", weights_format="official")
    assert all(b.name != "dequantized_weights" for b in short.chunk_activations)
    assert all(b.name != "dequantized_weights" for b in plan_for(d, None, 4096, 512, 64, "float32").chunk_activations)

    quantized = ModelRunner(model, 512, 64, 4096).memory_snapshot()["planned_workspace"]
    dense = ModelRunner(load_model(d, dtype="float32", weights_dtype="float32"), 512, 64, 4096)
    assert quantized - dense.memory_snapshot()["planned_workspace"] == max(per_layer)
