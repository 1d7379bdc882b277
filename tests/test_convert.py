"""`tessera convert`: MLX-native quantized checkpoints that the loader reads back, smaller than the
source, close to it in logits (`check reference --against`), lossless where the formats agree."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.loader import load_model
from tessera.engine.model.quantized import QuantizedWeight
from tessera.engine.tools.convert import ConvertError, convert
from tessera.engine.tools.make_model import make_model, preset_config
from tessera.engine.tools.official_checkpoint import write_official_checkpoint
from tessera.engine.tools.reference_check import check_against


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("plain"), "tiny", seed=6, with_tokenizer=False)


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    return write_official_checkpoint(tmp_path_factory.mktemp("official"), preset_config("tiny"), seed=7)


def test_official_fp4_experts_to_mxfp4_is_lossless(official_dir, tmp_path):
    report = convert(official_dir, tmp_path / "c", "mxfp4")
    src, out = load_model(official_dir), load_model(tmp_path / "c")
    a, b = src.weights["layers.2.ffn.experts.w3"], out.weights["layers.2.ffn.experts.w3"]
    assert isinstance(b, QuantizedWeight) and b.mode == "mxfp4"
    assert np.array_equal(np.array(a.values), np.array(b.values)) and np.array_equal(np.array(a.scales), np.array(b.scales))
    assert out.weights["layers.2.attn.wq_a.weight"].mode == "mxfp8"  # dense kept as the source's FP8
    against = check_against(tmp_path / "c", official_dir, 40, chunk=16, tile=8, decode=4)
    assert against.max_abs_diff == 0.0 and against.top1_agreement == 1.0
    assert report.bytes_after <= report.bytes_before * 1.02  # same bytes, 128×128 FP8 scales repeated per 32


def test_plain_to_affine8_dense_round_trip(plain_dir, tmp_path):
    report = convert(plain_dir, tmp_path / "c", "affine8", group_size=32, dense=True)
    assert report.bytes_after < 0.75 * report.bytes_before  # fp32 projections -> 8 bits + fp32 scale/bias per 32 (embed/head stay fp32)
    model = load_model(tmp_path / "c", dtype="float32")
    w = model.weights["layers.1.attn.wo_a.weight"]
    assert isinstance(w, QuantizedWeight) and (w.mode, w.bits, w.group_size) == ("affine", 8, 32)
    assert model.weights["layers.1.ffn.experts.w2"].shape == (4, 64, 32)
    against = check_against(tmp_path / "c", plain_dir, 60, chunk=25, tile=10, decode=5)
    assert against.kl_mean < 1e-3 and against.top1_agreement >= 0.9, against
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["tessera_quantization"] == {"experts": "affine8", "dense": "affine8", "group_size": 32}


def test_affine4_is_further_from_source_than_affine8(plain_dir, tmp_path):
    convert(plain_dir, tmp_path / "a4", "affine4", group_size=32)
    convert(plain_dir, tmp_path / "a8", "affine8", group_size=32)
    kl4 = check_against(tmp_path / "a4", plain_dir, 40).kl_mean
    kl8 = check_against(tmp_path / "a8", plain_dir, 40).kl_mean
    assert 0 < kl8 < kl4


def test_conversion_of_a_conversion_loads(official_dir, tmp_path):
    convert(official_dir, tmp_path / "once", "affine8", group_size=32, dense=True)
    convert(tmp_path / "once", tmp_path / "twice", "mxfp4", dense=True)
    model = load_model(tmp_path / "twice")
    assert model.weights["layers.0.attn.wo_b.weight"].mode == "mxfp4"
    assert model.weights["embed.weight"].dtype == mx.bfloat16


def test_bad_group_size_is_named(plain_dir, tmp_path):
    with pytest.raises(ConvertError, match="--group-size: mxfp4 groups are 32"):
        convert(plain_dir, tmp_path / "c", "mxfp4", group_size=64)
    with pytest.raises(ConvertError, match=r"tensor 'layers.0.attn.wq_b.weight' \(128, 32\): input dimension is not a multiple of --group-size 64"):
        convert(plain_dir, tmp_path / "d", "affine4", dense=True)


def test_official_to_affine4_has_bf16_scales_and_is_smaller_than_affine8(official_dir, tmp_path):
    a4 = convert(official_dir, tmp_path / "a4", "affine4", group_size=32, dense=True)
    a8 = convert(official_dir, tmp_path / "a8", "affine8", group_size=32, dense=True)
    assert a4.bytes_after < a8.bytes_after
    w = load_model(tmp_path / "a4").weights["layers.3.ffn.experts.w1"]
    assert (w.mode, w.bits) == ("affine", 4) and w.scales.dtype == mx.bfloat16 and w.biases.dtype == mx.bfloat16


def test_cli_make_model_official_then_convert_reports_bytes(tmp_path):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tessera.engine.tools.commands", *args], capture_output=True, text=True)

    made = cli("make-model", str(tmp_path / "src"), "--format", "official", "--no-tokenizer", "--seed", "2")
    assert made.returncode == 0 and "wrote official checkpoint" in made.stdout
    out = cli("convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--quant", "affine8", "--group-size", "32", "--json")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and 0 < report["bytes_after"] and report["bytes_before"] > 0
    bad = cli("convert", str(tmp_path / "src"), str(tmp_path / "bad"), "--quant", "mxfp4", "--group-size", "64")
    assert bad.returncode == 2 and "--group-size: mxfp4 groups are 32" in bad.stderr
    (tmp_path / "broken.json").write_text(json.dumps({"model_type": "llama"}))
    refused = cli("make-model", str(tmp_path / "x"), "--format", "official", "--config", str(tmp_path / "broken.json"), "--no-tokenizer")
    assert refused.returncode == 2 and "model_type" in refused.stderr
