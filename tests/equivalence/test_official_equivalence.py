"""Official-format (FP8 dense + FP4 experts) checkpoints: Tessera computing on the MLX quantized
arrays (quantized_matmul, gather_qmm) equals transformers' dequantized float32 forward within 1e-4
in every path a server uses: whole prefill, chunked prefill, tiled indexer/attention, decode."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tessera.engine.model import attention, quantized
from tessera.engine.model.config import CSA, HCA
from tessera.engine.model.loader import load_model
from tessera.engine.model.quantized import QuantizedWeight
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.reference_check import compare, reference_logits, tessera_logits
from tessera.engine.tools.replay import random_tokens
from tests.equivalence.row_invariant_blas import row_invariant_blas

TOLERANCE = 1e-4


def _reviewer_config(path):
    """A config.json written by transformers, in widths the presets do not use (8 index heads)."""
    cfg = transformers.DeepseekV4Config(
        vocab_size=512, hidden_size=256, moe_intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=32, q_lora_rank=128, o_groups=2, o_lora_rank=64, sliding_window=8,
        n_routed_experts=6, num_experts_per_tok=3, index_n_heads=8, index_head_dim=32, index_topk=8,
        layer_types=[CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 16}, mlp_layer_types=["hash_moe", "moe", "moe"],
        max_position_embeddings=4096)
    path.write_text(json.dumps(cfg.to_dict()))
    return path


CASES = {
    "tiny-preset": dict(preset="tiny", config=False, seed=4, num_tokens=180, decode=24),
    "reviewer-config": dict(preset=None, config=True, seed=5, num_tokens=120, decode=24),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    spec = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    config_file = _reviewer_config(root / "config.json") if spec["config"] else None
    model_dir = make_model(root / "model", spec["preset"] or "tiny", seed=spec["seed"], with_tokenizer=False,
                           fmt="official", config_file=config_file)
    model = load_model(model_dir, dtype="float32")
    assert isinstance(model.weights["layers.0.attn.wq_a.weight"], QuantizedWeight)
    assert isinstance(model.weights["layers.0.ffn.experts.w1"], QuantizedWeight)
    tokens = random_tokens(model.cfg.vocab_size, spec["num_tokens"] + spec["decode"], seed=spec["seed"])
    return spec, model, tokens, reference_logits(model_dir, tokens)


def test_whole_prefill(case):
    spec, model, tokens, ref = case
    ours = tessera_logits(model, tokens, len(tokens), len(tokens), None)
    assert compare(ours, ref, len(tokens), len(tokens), len(tokens)).max_abs_diff <= TOLERANCE


@pytest.mark.parametrize("chunk,tile", [(37, None), (64, 16), (50, 7)])
def test_chunked_and_tiled_prefill(case, chunk, tile):
    spec, model, tokens, ref = case
    n = spec["num_tokens"]
    ours = tessera_logits(model, tokens[:n], n, chunk, tile)
    assert compare(ours, ref[:n], n, chunk, tile or chunk).max_abs_diff <= TOLERANCE


def test_decode(case):
    spec, model, tokens, ref = case
    n = spec["num_tokens"]
    ours = tessera_logits(model, tokens, n, 64, 16)
    report = compare(ours, ref, n, 64, 16)
    assert report.decode == spec["decode"]
    assert report.decode_max_abs_diff <= TOLERANCE and report.max_abs_diff <= TOLERANCE


@row_invariant_blas
def test_dense_prefill_path_matches_the_reference_and_tiles_bit_exactly(case, monkeypatch):
    """Chunks of >= dense_min_rows() rows run dense matmuls on transiently dequantized weights (decode
    stays quantized). Lowered thresholds put the tiny model on that path, with several projection
    blocks per chunk: still within 1e-4 of transformers, and tiled == untiled bit for bit."""
    spec, model, tokens, ref = case
    n = spec["num_tokens"]
    all_quantized = tessera_logits(model, tokens, n, 64, None)
    monkeypatch.setattr(quantized, "_dense_min_rows", 24)
    monkeypatch.setattr(attention, "PROJECTION_ROWS", 16)
    untiled = tessera_logits(model, tokens, n, 64, None)
    tiled = tessera_logits(model, tokens, n, 64, 7)
    assert not np.array_equal(untiled, all_quantized), "the dense path never ran"
    assert np.array_equal(tiled, untiled)
    report = compare(tiled, ref, n, 64, 7)
    assert report.max_abs_diff <= TOLERANCE and report.decode_max_abs_diff <= TOLERANCE
