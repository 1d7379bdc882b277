"""Random official-format weights made in memory (engine/model/random_weights.py): a random-weights
directory loads into exactly the arrays an official checkpoint of the same config loads into (names,
shapes, dtypes, quantization modes), for any layer range, with values that depend only on (seed, name)
and realistic magnitudes; a forward pass runs on them."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import CheckpointError, load_model
from tessera.engine.model.quantized import QuantizedWeight
from tessera.engine.model.random_weights import RANDOM_WEIGHTS_FILE
from tessera.engine.tools.make_model import make_model, preset_config, write_random_weights_dir
from tessera.engine.tools.official_checkpoint import write_official_checkpoint
from tessera.engine.tools.replay import random_tokens


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cfg = preset_config("tiny")
    written = write_official_checkpoint(tmp_path_factory.mktemp("written"), cfg, seed=1)
    in_memory = write_random_weights_dir(tmp_path_factory.mktemp("in_memory"), cfg, seed=1)
    return written, in_memory


def _signature(w):
    if isinstance(w, QuantizedWeight):
        return ("q", w.mode, w.bits, w.group_size, w.values.shape, w.values.dtype, w.scales.shape, w.scales.dtype,
                w.biases is None)
    return ("a", w.shape, w.dtype)


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_in_memory_weights_have_the_official_loaders_names_shapes_dtypes_and_modes(dirs, dtype):
    written, in_memory = (load_model(d, dtype=dtype, progress=False).weights for d in dirs)
    assert sorted(written) == sorted(in_memory)
    for name in written:
        assert _signature(in_memory[name]) == _signature(written[name]), name
    modes = {w.mode for w in in_memory.values() if isinstance(w, QuantizedWeight)}
    assert modes == {"mxfp8", "mxfp4"}  # dense projections and experts both quantized, as loaded


def test_a_layer_range_holds_exactly_its_layers_and_the_same_values(dirs):
    _, in_memory = dirs
    whole = load_model(in_memory, dtype="float32", progress=False)
    stage = load_model(in_memory, dtype="float32", progress=False, layers=range(2, 4), vocab=False)
    assert "embed.weight" not in stage.weights and "head.weight" not in stage.weights
    assert {n.split(".")[1] for n in stage.weights if n.startswith("layers.")} == {"2", "3"}
    for name, w in stage.weights.items():  # values depend on (seed, name) only, not on the range loaded
        a, b = (x.values if isinstance(x, QuantizedWeight) else x for x in (w, whole.weights[name]))
        assert mx.array_equal(a, b).item(), name


def test_magnitudes_match_the_written_checkpoints(dirs):
    written, in_memory = (load_model(d, dtype="float32", progress=False).weights for d in dirs)
    for name in ("layers.1.attn.wq_b.weight", "layers.1.ffn.experts.w1", "layers.1.attn.compressor.wkv.weight",
                 "layers.1.attn_norm.weight", "embed.weight"):
        a, b = (w.dequantize() if isinstance(w, QuantizedWeight) else w for w in (written[name], in_memory[name]))
        ra, rb = (float(mx.sqrt(mx.mean(x * x))) for x in (a, b))
        assert 0.8 < rb / ra < 1.25, (name, ra, rb)
    tid = np.array(in_memory["layers.0.ffn.gate.tid2eid"])
    assert all(len(set(row)) == len(row) for row in tid[:64])  # distinct experts per token


def test_a_forward_pass_runs_and_differs_by_seed(tmp_path):
    cfg = preset_config("tiny")
    logits = []
    for seed in (0, 1):
        d = write_random_weights_dir(tmp_path / f"s{seed}", cfg, seed=seed)
        model = load_model(d, dtype="float32", progress=False)
        cache = model.new_cache()
        out = model.forward([Segment(cache, random_tokens(cfg.vocab_size, 40, seed=0))], tile=8)[0]
        assert out.shape == (1, cfg.vocab_size) and bool(mx.all(mx.isfinite(out)).item())
        logits.append(out)
    assert not mx.allclose(logits[0], logits[1]).item()


def test_make_model_in_memory_writes_no_weights(tmp_path):
    d = make_model(tmp_path / "m", "tiny", seed=5, with_tokenizer=False, fmt="official", in_memory=True)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", RANDOM_WEIGHTS_FILE]
    assert json.loads((d / RANDOM_WEIGHTS_FILE).read_text()) == {"format": "official", "seed": 5}
    assert json.loads((d / "config.json").read_text())["expert_dtype"] == "fp4"
    with pytest.raises(ValueError, match="--format official"):
        make_model(tmp_path / "p", "tiny", with_tokenizer=False, fmt="plain", in_memory=True)


def test_a_directory_with_both_weights_and_the_spec_is_refused(tmp_path, dirs):
    written, _ = dirs
    d = tmp_path / "both"
    d.mkdir()
    for f in written.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / RANDOM_WEIGHTS_FILE).write_text('{"format": "official", "seed": 0}')
    with pytest.raises(CheckpointError, match="both"):
        load_model(d, progress=False)


def test_v4_flash_preset_is_the_real_layer_pattern():
    cfg = preset_config("v4-flash")
    assert cfg.num_hidden_layers == 43 and cfg.n_routed_experts == 256 and cfg.vocab_size == 129280
    assert cfg.compress_ratio(0) == cfg.compress_ratio(1) == 0
    assert [cfg.compress_ratio(i) for i in range(2, 43)] == [4 if i % 2 == 0 else 128 for i in range(41)]
    assert cfg.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)


def test_tid2eid_is_sorted_in_row_blocks_the_gpu_accepts():
    from tessera.engine.model.random_weights import SORT_ROWS, random_tid2eid

    assert SORT_ROWS <= 65535  # MLX's GPU sort limit per call
    key = mx.random.key(0)
    blocked = random_tid2eid((100, 6), 32, key, rows_per_sort=7)
    assert blocked.shape == (100, 6) and blocked.dtype == mx.int64
    assert mx.array_equal(blocked, random_tid2eid((100, 6), 32, key)).item()  # blocks change nothing
    assert all(len(set(row)) == 6 for row in np.array(blocked).tolist())


@pytest.mark.parametrize("cols", [64, 4096])
def test_random_fp4_experts_have_the_writers_scale_on_host_and_device(cols):
    """Both random FP4 draws (the checkpoint writer's on the host, random_weights' on the device) put an
    expert weight's RMS near 1/sqrt(in), from one rule (official_format.fp4_base_exponent)."""
    from tessera.engine.model.official_format import dequantize_fp4, random_fp4
    from tessera.engine.model.random_weights import random_fp4_stacked

    host = dequantize_fp4(*random_fp4((64, cols), np.random.default_rng(0)))
    device = np.array(random_fp4_stacked(2, (64, cols), mx.random.key(0)).dequantize(mx.float32))
    for values in (host, device):
        ratio = float(np.sqrt(np.mean(values**2)) * np.sqrt(cols))
        assert 0.7 < ratio < 1.4, ratio
