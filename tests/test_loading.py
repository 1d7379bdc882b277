"""Loading checkpoints: clear errors that name the problem, both config spellings, sharded files,
and interchange with transformers in both directions."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.config import ConfigError, config_from_dict
from tessera.engine.model.loader import CheckpointError, load_model
from tessera.engine.tools.make_model import make_model, preset_config
from tessera.engine.tools.reference_check import tessera_logits
from tessera.engine.tools.replay import random_tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=5, with_tokenizer=False)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found: .*nope"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="missing file: .*config.json"):
        load_model(tmp_path)


def test_missing_weights_file(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing file: no \*.safetensors"):
        load_model(d)


def test_unknown_model_type(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        load_model(d)


def _rewrite(d, edit):
    tensors = mx.load(str(d / "model.safetensors"))
    edit(tensors)
    mx.save_safetensors(str(d / "model.safetensors"), tensors, metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    _rewrite(d, lambda t: t.pop("layers.1.attn.indexer.wq_b.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.1.attn.indexer.wq_b.weight'"):
        load_model(d)


def test_unexpected_tensor_is_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    _rewrite(d, lambda t: t.__setitem__("layers.0.attn.extra.weight", mx.zeros((2, 2))))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers.0.attn.extra.weight'"):
        load_model(d)


def test_shape_mismatch_names_tensor_and_both_shapes(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    _rewrite(d, lambda t: t.__setitem__("layers.2.attn.wkv.weight", mx.zeros((31, 64))))
    with pytest.raises(CheckpointError, match=r"'layers.2.attn.wkv.weight': checkpoint has \(31, 64\), config expects \(32, 64\)"):
        load_model(d)


def test_sharded_checkpoint_with_model_prefix_loads_equal(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "m")
    tensors = mx.load(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        mx.save_safetensors(str(d / shard), {"model." + k: tensors[k] for k in keys}, metadata={"format": "pt"})
        weight_map.update({"model." + k: shard for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tokens = random_tokens(2048, 50, 0)
    a = tessera_logits(load_model(tiny_dir), tokens, 50, 50, None)
    b = tessera_logits(load_model(d), tokens, 50, 50, None)
    assert np.array_equal(a, b)


def test_bfloat16_checkpoint_loads_and_computes_in_float32(tmp_path):
    d = make_model(tmp_path / "bf16", "tiny", seed=5, with_tokenizer=False, dtype="bfloat16")
    model = load_model(d, dtype="float32")
    assert model.weights["embed.weight"].dtype == mx.float32
    assert np.isfinite(tessera_logits(model, random_tokens(2048, 20, 0), 20, 20, None)).all()


def test_norms_and_router_are_held_in_float32_with_the_compute_dtypes_values(tiny_dir):
    """Loaded for bf16 compute, the norm weights, the router and its bias are float32 (what the norms and routing
    scores compute in; no cast in every step's graph) holding exactly the bf16 values the other weights were rounded
    to, so the logits are those of casting them each step; the hash layers' expert table is uint32 (the top-k's dtype)."""
    as_bf16 = load_model(tiny_dir, dtype="bfloat16", progress=False)
    as_loaded = load_model(tiny_dir, progress=False)  # the checkpoint's float32
    cfg, names = as_bf16.cfg, ["norm.weight"]
    for i in range(cfg.num_hidden_layers):
        names += [f"layers.{i}.{n}" for n in ("attn_norm.weight", "ffn_norm.weight", "attn.q_norm.weight", "attn.norm.weight",
                                             "ffn.gate.weight")]
        names += [f"layers.{i}.ffn.gate.bias"] if f"layers.{i}.ffn.gate.bias" in as_bf16.weights else []
    for name in names:
        held, original = as_bf16.weights[name], as_loaded.weights[name]
        assert held.dtype == mx.float32, name
        assert mx.array_equal(held, original.astype(mx.bfloat16).astype(mx.float32)).item(), name
    tables = [w for n, w in as_bf16.weights.items() if n.endswith("gate.tid2eid")]
    assert tables and all(t.dtype == mx.uint32 for t in tables)
    assert as_bf16.dtype == mx.bfloat16 and as_bf16.new_cache().layers[0].window.dtype == mx.bfloat16  # the compute dtype, not the norms'


def test_official_config_spelling_equals_transformers_spelling():
    official = {
        "model_type": "deepseek_v4", "num_hidden_layers": 5, "compress_ratios": [0, 0, 4, 128, 4],
        "num_hash_layers": 3, "qk_rope_head_dim": 64, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    }
    cfg = config_from_dict(official)
    assert cfg.layer_types[:3] == ("sliding_attention", "sliding_attention", "compressed_sparse_attention")
    assert cfg.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 2
    assert cfg.compress_rope.yarn_factor == 16 and cfg.compress_rope.attention_factor == 1.0
    assert cfg.main_rope.yarn_factor is None
    assert config_from_dict(cfg.to_transformers_dict()) == cfg


def test_a_single_hyper_connection_stream_is_refused_by_name():
    with pytest.raises(ConfigError, match="hc_mult must be ≥ 2"):
        config_from_dict({"model_type": "deepseek_v4", "num_hidden_layers": 2, "hc_mult": 1})


def test_unsupported_ratio_is_named():
    with pytest.raises(ConfigError, match="compress_ratios: unsupported ratio"):
        config_from_dict({"model_type": "deepseek_v4", "num_hidden_layers": 2, "compress_ratios": [0, 16]})


# ---- interchange with transformers -------------------------------------------------------------


def test_make_model_checkpoint_loads_in_transformers(tiny_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    ours = load_model(tiny_dir)
    state = model.state_dict()
    np.testing.assert_array_equal(state["model.layers.1.self_attn.compressor.position_bias"].numpy(),
                                  np.array(ours.weights["layers.1.attn.compressor.ape"]))
    np.testing.assert_array_equal(state["model.layers.0.mlp.gate.tid2eid"].numpy(),
                                  np.array(ours.weights["layers.0.ffn.gate.tid2eid"]))
    assert state["model.layers.0.mlp.gate.tid2eid"].any(), "tid2eid must be randomized, not zeros"


def test_transformers_save_pretrained_checkpoint_loads_with_equal_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = preset_config("tiny", num_hash_layers=1)
    hf_config = transformers.DeepseekV4Config(**{k: v for k, v in cfg.to_transformers_dict().items()
                                                 if k not in ("model_type", "architectures", "dtype")})
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_config).float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # randomize every parameter and buffer: default init hides bugs
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if p.ndim == 1 else p.shape[-1] ** -0.5))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    model.save_pretrained(tmp_path / "hf")
    tokens = random_tokens(cfg.vocab_size, 300, 7)
    with torch.no_grad():
        ref = model(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
    ours = tessera_logits(load_model(tmp_path / "hf"), tokens, 300, 300, None)
    assert np.abs(ours - ref).max() <= 1e-4
