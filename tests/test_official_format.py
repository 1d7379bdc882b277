"""DeepSeek V4's official FP8/FP4 checkpoint format: the byte formats agree with torch and
transformers, make-model writes exactly the published layout, the loader maps it onto MLX quantized
arrays without a float copy, and bad files fail with an error naming the tensor and its shape."""

from __future__ import annotations

import json
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.fp_formats import E4M3_VALUES, decode_e8m0, encode_e4m3, pack_e2m1, unpack_e2m1
from tessera.engine.model.loader import CheckpointError, load_model
from tessera.engine.model.official_format import (
    dequantize_fp4, dequantize_fp8, mxfp4_from_packed, mxfp8_from_blocks, quantize_fp8, random_fp4, storage,
)
from tessera.engine.model import quantized
from tessera.engine.model.quantized import QuantizedWeight, dense_min_rows, linear, quantize
from tessera.engine.model.safetensors_file import open_tensors, read_header, write_file
from tessera.engine.tools.make_model import make_model, preset_config
from tessera.engine.tools.official_checkpoint import write_official_checkpoint
from tessera.engine.tools.reference_check import tessera_logits
from tessera.engine.tools.replay import random_tokens


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    """The tiny preset in the official format, in 3+ shards (small shard size)."""
    d = tmp_path_factory.mktemp("official")
    return write_official_checkpoint(d, preset_config("tiny"), seed=3, shard_bytes=400_000)


def _headers(d):
    out = {}
    for f in sorted(d.glob("model-*.safetensors")):
        out.update({k: (v["dtype"], tuple(v["shape"]), f.name) for k, v in read_header(f)[0].items()})
    return out


# ---- byte formats ------------------------------------------------------------------------------


def test_e4m3_and_e8m0_tables_equal_torch():
    torch = pytest.importorskip("torch")
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(E4M3_VALUES, ref)  # NaNs in the same places compare equal
    ref_e8m0 = codes[:255].view(torch.float8_e8m0fnu).float().numpy()
    np.testing.assert_array_equal(decode_e8m0(np.arange(255, dtype=np.uint8)), ref_e8m0)


def test_e4m3_encoding_rounds_to_nearest_like_torch():
    torch = pytest.importorskip("torch")
    x = (np.random.default_rng(0).standard_normal(4096) * 50).astype(np.float32)
    ours = encode_e4m3(x)
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert (ours == theirs).mean() > 0.999  # ties may round either way; values must agree
    np.testing.assert_array_equal(E4M3_VALUES[ours], torch.from_numpy(x).to(torch.float8_e4m3fn).float().numpy())


def test_fp4_nibble_order_equals_transformers():
    pytest.importorskip("torch")
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    packed = np.random.default_rng(1).integers(0, 256, size=(3, 16), dtype=np.uint8).view(np.int8)
    theirs = Fp8Dequantize(None)._unpack_fp4(torch.from_numpy(packed.copy())).numpy()
    np.testing.assert_array_equal(unpack_e2m1(packed), theirs)
    np.testing.assert_array_equal(pack_e2m1(theirs), packed)


@pytest.mark.parametrize("shape", [(256, 384), (64, 96), (128, 64)])
def test_fp8_blocks_become_mxfp8_exactly(shape):
    w = np.random.default_rng(2).standard_normal(shape).astype(np.float32) * np.linspace(0.01, 3, shape[1])
    codes, scale = quantize_fp8("t", w)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    q = mxfp8_from_blocks(codes, scale)
    assert q.mode == "mxfp8" and q.values.dtype == mx.uint32 and q.shape == shape
    np.testing.assert_array_equal(np.array(q.dequantize(mx.float32)), dequantize_fp8(codes, scale))
    assert np.abs(dequantize_fp8(codes, scale) - w).max() <= np.abs(w).max() / 8  # e4m3: 3 mantissa bits


def test_fp4_experts_become_mxfp4_exactly():
    packed, scale = random_fp4((64, 96), np.random.default_rng(3))
    q = mxfp4_from_packed(packed, scale)
    assert q.mode == "mxfp4" and q.shape == (64, 96)
    np.testing.assert_array_equal(np.array(q.dequantize(mx.float32)), dequantize_fp4(packed, scale))


def test_storage_kinds_follow_transformers_lists():
    assert storage("layers.0.attn.wq_a.weight") == "fp8"
    assert storage("layers.3.attn.indexer.wq_b.weight") == "fp8"
    assert storage("layers.3.ffn.shared_experts.w2.weight") == "fp8"
    assert storage("layers.3.ffn.experts.17.w3.weight") == "fp4"
    for bf16 in ("layers.3.attn.compressor.wkv.weight", "layers.3.attn.indexer.compressor.wgate.weight",
                 "layers.3.attn.indexer.weights_proj.weight", "embed.weight", "head.weight", "layers.0.ffn.gate.weight"):
        assert storage(bf16) == "bf16", bf16
    for fp32 in ("layers.0.attn.norm.weight", "layers.0.hc_attn_fn", "hc_head_scale", "layers.0.attn.attn_sink",
                 "layers.1.attn.compressor.ape", "layers.1.ffn.gate.bias"):
        assert storage(fp32) == "fp32", fp32


# ---- the written checkpoint --------------------------------------------------------------------


def test_make_model_official_layout(official_dir):
    h = _headers(official_dir)
    assert h["layers.1.attn.wq_a.weight"][:2] == ("F8_E4M3", (32, 64))
    assert h["layers.1.attn.wq_a.scale"][:2] == ("F8_E8M0", (1, 1))
    assert h["layers.1.attn.indexer.wq_b.weight"][:2] == ("F8_E4M3", (1024, 32))
    assert h["layers.1.attn.indexer.wq_b.scale"][:2] == ("F8_E8M0", (8, 1))
    assert h["layers.1.ffn.experts.3.w2.weight"][:2] == ("I8", (64, 16))  # [out, in/2]
    assert h["layers.1.ffn.experts.3.w2.scale"][:2] == ("F8_E8M0", (64, 1))  # [out, in/32]
    assert h["layers.1.attn.compressor.wkv.weight"][0] == "BF16"
    assert h["layers.1.attn.norm.weight"][0] == "F32" and h["layers.1.hc_ffn_base"][0] == "F32"
    assert "layers.1.attn.compressor.wkv.scale" not in h
    index = json.loads((official_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert {k: v[2] for k, v in h.items()} == index["weight_map"]
    config = json.loads((official_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["scale_fmt"] == "ue8m0" and config["expert_dtype"] == "fp4"


def test_make_model_official_is_deterministic(tmp_path):
    a = write_official_checkpoint(tmp_path / "a", preset_config("tiny"), seed=9)
    b = write_official_checkpoint(tmp_path / "b", preset_config("tiny"), seed=9)
    for f in a.glob("*.safetensors"):
        assert f.read_bytes() == (b / f.name).read_bytes()


def test_shapes_transformers_cannot_dequantize_are_refused():
    from tessera.engine.model.official_format import FormatError

    with pytest.raises(FormatError, match=r"'layers.0.attn.wq_b.weight' \(200, 64\)"):
        quantize_fp8("layers.0.attn.wq_b.weight", np.zeros((200, 64), np.float32))


def test_transformers_dequantizes_to_our_values(official_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(str(official_dir), dtype=torch.float32)
    state = model.state_dict()
    raw = {}
    for f in official_dir.glob("model-*.safetensors"):
        raw.update(open_tensors(f))
    wq = dequantize_fp8(raw["layers.2.attn.wq_b.weight"].data, raw["layers.2.attn.wq_b.scale"].data)
    np.testing.assert_array_equal(state["model.layers.2.self_attn.q_b_proj.weight"].float().numpy(), wq)
    w1 = dequantize_fp4(raw["layers.2.ffn.experts.1.w1.weight"].data, raw["layers.2.ffn.experts.1.w1.scale"].data)
    inter = w1.shape[0]
    np.testing.assert_array_equal(state["model.layers.2.mlp.experts.gate_up_proj"][1, :inter].float().numpy(), w1)


# ---- loading -----------------------------------------------------------------------------------


def test_loader_keeps_weights_quantized(official_dir):
    model = load_model(official_dir, dtype="float32")
    wq = model.weights["layers.1.attn.wq_b.weight"]
    assert isinstance(wq, QuantizedWeight) and wq.mode == "mxfp8" and wq.values.dtype == mx.uint32
    experts = model.weights["layers.1.ffn.experts.w1"]
    assert isinstance(experts, QuantizedWeight) and experts.mode == "mxfp4" and experts.shape == (4, 32, 64)
    assert model.weights["layers.1.attn.compressor.wkv.weight"].dtype == mx.float32


def test_weights_dtype_dequantizes_at_load_with_equal_logits(official_dir):
    quantized = load_model(official_dir, dtype="float32")
    plain = load_model(official_dir, dtype="float32", weights_dtype="bfloat16")
    assert isinstance(plain.weights["layers.1.ffn.experts.w1"], mx.array)
    tokens = random_tokens(2048, 40, 0)
    a = tessera_logits(quantized, tokens, 30, 30, None)
    b = tessera_logits(plain, tokens, 30, 30, None)
    assert np.abs(a - b).max() <= 1e-4


# (not affine: MLX's CPU quantized_matmul computes it as dequantize + gemm, bit-equal to the dense path)
@pytest.mark.parametrize("mode", ["mxfp8", "mxfp4"])
def test_many_rows_run_dense_on_the_dequantized_weight_and_few_rows_run_quantized_matmul(mode):
    mx.random.seed(0)
    w = quantize(mx.random.normal((96, 128)), mode, 32)
    threshold = dense_min_rows()
    x = mx.random.normal((threshold, 128))
    dense = x @ w.dequantize(mx.float32).T
    packed = lambda rows: mx.quantized_matmul(rows, w.values, w.scales, w.biases, transpose=True,  # noqa: E731
                                              group_size=w.group_size, bits=w.bits, mode=w.mode)
    # the two paths round differently, so bit equality says which one ran
    assert not mx.array_equal(dense, packed(x)) and mx.abs(dense - packed(x)).max().item() < 1e-4
    assert mx.array_equal(linear(x, w), dense)
    assert mx.array_equal(linear(x[: threshold - 1], w), packed(x[: threshold - 1]))


@pytest.mark.parametrize("value, rows", [(None, 256), ("8", 8), ("1", 1)])
def test_the_dense_threshold_comes_from_the_environment(value, rows, monkeypatch):
    if value is None:
        monkeypatch.delenv(quantized.DENSE_MIN_ROWS_ENV, raising=False)
    else:
        monkeypatch.setenv(quantized.DENSE_MIN_ROWS_ENV, value)
    assert quantized._rows_from_env() == rows


@pytest.mark.parametrize("value", ["0", "-8", "eight", "8.5", ""])
def test_a_bad_dense_threshold_is_refused_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(quantized.DENSE_MIN_ROWS_ENV, value)
    with pytest.raises(ValueError, match="TESSERA_DENSE_MIN_ROWS must be a positive integer"):
        quantized._rows_from_env()
    with pytest.raises(ValueError, match="at least 1"):
        quantized.set_dense_min_rows(0)


def test_a_lowered_threshold_sends_a_decode_batch_through_the_dense_path(tmp_path):
    """TESSERA_DENSE_MIN_ROWS=8: a decode step of 16 sequences runs the attention and shared-expert projections
    on dequantized weights (other bits than quantized_matmul's, within rounding); a step of 4 keeps the
    packed path (the default's bits)."""
    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.model.loader import load_model
    from tessera.engine.tools.make_model import make_model
    from tessera.engine.tools.replay import random_tokens

    model = load_model(make_model(tmp_path / "m", "tiny", seed=5, with_tokenizer=False, fmt="official"), dtype="float32")

    def step(batch: int, threshold: int) -> np.ndarray:
        caches = [model.new_cache() for _ in range(batch)]
        for b, c in enumerate(caches):  # prompts of 40 rows: packed at the default threshold
            mx.eval(model.forward([Segment(c, random_tokens(model.cfg.vocab_size, 40, b))]))
        saved = dense_min_rows()
        quantized.set_dense_min_rows(threshold)
        try:
            return np.array(mx.concatenate(model.forward([Segment(c, [3]) for c in caches])))
        finally:
            quantized.set_dense_min_rows(saved)

    packed16, dense16 = step(16, 256), step(16, 8)
    assert not np.array_equal(packed16, dense16), "the dense path never ran"
    np.testing.assert_allclose(dense16, packed16, atol=1e-4 * float(np.abs(packed16).max()))
    assert np.array_equal(step(4, 256), step(4, 8))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(d, name, edit):
    """Rewrites the shard holding `name` with `edit(tensors)` applied to {name: (tag, array)}."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"][name]
    tensors = {k: (t.dtype, np.array(t.data)) for k, t in open_tensors(shard).items()}
    edit(tensors)
    write_file(shard, tensors)


def test_missing_scale_is_named(official_dir, tmp_path):
    d = _copy(official_dir, tmp_path / "m")
    _rewrite_shard(d, "layers.2.ffn.experts.0.w3.scale", lambda t: t.pop("layers.2.ffn.experts.0.w3.scale"))
    with pytest.raises(CheckpointError, match=r"missing scale 'layers.2.ffn.experts.0.w3.scale' for tensor 'layers.2.ffn.experts.0.w3.weight' I8 \(32, 32\)"):
        load_model(d)


def test_missing_quantized_weight_is_named_with_its_shape(official_dir, tmp_path):
    d = _copy(official_dir, tmp_path / "m")
    _rewrite_shard(d, "layers.1.attn.wq_a.weight", lambda t: t.pop("layers.1.attn.wq_a.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.1.attn.wq_a.weight' \(config expects \(32, 64\)\)"):
        load_model(d)


def test_wrong_scale_dtype_is_named(official_dir, tmp_path):
    d = _copy(official_dir, tmp_path / "m")
    name = "layers.0.attn.wo_b.scale"
    _rewrite_shard(d, name, lambda t: t.__setitem__(name, ("F32", t[name][1].astype(np.float32))))
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.attn.wo_b.scale' \(1, 1\) has dtype F32, expected F8_E8M0"):
        load_model(d)


def test_wrong_weight_dtype_is_named(official_dir, tmp_path):
    d = _copy(official_dir, tmp_path / "m")
    name = "layers.0.attn.norm.weight"
    _rewrite_shard(d, name, lambda t: t.__setitem__(name, ("U8", np.zeros(32, np.uint8))))
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.attn.norm.weight' \(32,\) has dtype U8"):
        load_model(d)


def test_wrong_packed_shape_is_named(official_dir, tmp_path):
    d = _copy(official_dir, tmp_path / "m")
    name = "layers.3.ffn.experts.2.w1.weight"
    _rewrite_shard(d, name, lambda t: t.__setitem__(name, ("I8", np.zeros((32, 64), np.int8))))
    with pytest.raises(CheckpointError, match=r"'layers.3.ffn.experts.2.w1.weight' \(packed FP4.*checkpoint has \(32, 64\), config expects \(32, 32\)"):
        load_model(d)


def test_truncated_shard_names_file_and_tensor(official_dir, tmp_path):
    d = _copy(official_dir, tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    (n,) = struct.unpack("<Q", data[:8])
    header = {k: v for k, v in json.loads(data[8 : 8 + n]).items() if k != "__metadata__"}
    cut = min((v["data_offsets"][0], k) for k, v in header.items() if v["data_offsets"][1] > len(data) - 100 - 8 - n)[1]
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated file: tensor '{cut}' {header[cut]['dtype']} \("):
        load_model(d)


def test_make_model_official_from_reviewer_config(tmp_path):
    """`--config` with a config.json written by transformers itself, in a shape the presets do not use."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config(
        vocab_size=300, hidden_size=256, moe_intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=32, q_lora_rank=128, o_groups=2, o_lora_rank=64, n_routed_experts=3,
        num_experts_per_tok=2, index_n_heads=8, index_head_dim=32, index_topk=4,
        layer_types=["compressed_sparse_attention", "sliding_attention"], mlp_layer_types=["hash_moe", "moe"])
    (tmp_path / "reviewer.json").write_text(json.dumps(cfg.to_dict()))
    d = make_model(tmp_path / "m", config_file=tmp_path / "reviewer.json", fmt="official", with_tokenizer=False)
    model = load_model(d, dtype="float32")
    assert model.cfg.moe_intermediate_size == 96 and model.weights["layers.0.ffn.experts.w2"].shape == (3, 256, 96)
    assert np.isfinite(tessera_logits(model, random_tokens(300, 12, 0), 12, 12, None)).all()


def test_progress_bar_counts_up_to_the_checkpoint_size(official_dir, monkeypatch, capsys):
    import tessera.engine.model.loader as loader

    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    load_model(official_dir)
    err = capsys.readouterr().err
    assert "loading weights [" in err
    final = err.strip().split("\r")[-1]
    assert "[" + "#" * 40 + "]" in final
