"""Tessera's logits equal transformers' full forward (docs/ARCHITECTURE.md) for three random configs that
together cover window/CSA/HCA layers, hash and learned routing, contexts below and above
`index_topk`, and many ratio-4 and ratio-128 boundaries: whole forward, chunked prefill (sizes not
aligned to 4 or 128) and ≥ 40 single-token decode steps, each against the full forward."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.tools.make_model import make_model
from tessera.engine.model.loader import load_model
from tessera.engine.tools.reference_check import compare, reference_logits, tessera_logits
from tessera.engine.tools.replay import random_tokens

TOLERANCE = 1e-4

CONFIGS = {
    # The tiny preset: V4 ratios (4, 128), 2 hash layers, window 16, top-k 16; 700 tokens cross
    # five ratio-128 boundaries and 175 ratio-4 ones, visible rows run from 0 to ~175 ≫ top-k.
    "tiny-v4-ratios": dict(preset="tiny", seed=1, overrides={}, num_tokens=660, decode=40),
    # Learned routing everywhere, HCA first, small HCA ratio so rows cross its boundary often.
    "hca-first-learned": dict(
        preset="tiny",
        seed=2,
        overrides=dict(
            layer_types=[HCA, CSA, WINDOW, CSA, HCA],
            num_hidden_layers=5,
            num_hash_layers=0,
            compress_rates={CSA: 4, HCA: 16},
            sliding_window=8,
            index_topk=24,
        ),
        num_tokens=301,
        decode=45,
    ),
    # Contexts below top-k (never more than 64 // 4 = 16 visible rows < 32) and all-hash routing.
    "below-topk-hash": dict(
        preset="tiny",
        seed=3,
        overrides=dict(layer_types=[CSA, CSA, HCA], num_hidden_layers=3, num_hash_layers=3,
                       compress_rates={CSA: 4, HCA: 8}, index_topk=32, sliding_window=5),
        num_tokens=23,
        decode=41,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    spec = CONFIGS[request.param]
    model_dir = tmp_path_factory.mktemp(request.param)
    make_model(model_dir, spec["preset"], seed=spec["seed"], with_tokenizer=False, **dict(spec["overrides"]))
    model = load_model(model_dir, dtype="float32")
    tokens = random_tokens(model.cfg.vocab_size, spec["num_tokens"] + spec["decode"], seed=spec["seed"])
    ref = reference_logits(model_dir, tokens)
    return request.param, spec, model, tokens, ref


def test_whole_forward_matches_reference(case):
    name, spec, model, tokens, ref = case
    ours = tessera_logits(model, tokens, len(tokens), len(tokens), None)
    report = compare(ours, ref, len(tokens), len(tokens), len(tokens))
    print(name, "whole forward max |Δlogit| =", report.max_abs_diff)
    assert report.max_abs_diff <= TOLERANCE


@pytest.mark.parametrize("chunk", [1, 7, 37, 130])
def test_chunked_prefill_matches_reference(case, chunk):
    name, spec, model, tokens, ref = case
    # Token-by-token prefill of a long context costs one forward per token: a 64-token prefix shows it.
    n = min(spec["num_tokens"], 64) if chunk == 1 else spec["num_tokens"]
    ours = tessera_logits(model, tokens[:n], n, chunk, None)
    report = compare(ours, ref[:n], n, chunk, chunk)
    print(name, f"chunk {chunk} max |Δlogit| =", report.max_abs_diff)
    assert report.prefill_max_abs_diff <= TOLERANCE


def test_prefill_then_decode_matches_full_forward_at_every_position(case):
    name, spec, model, tokens, ref = case
    n = spec["num_tokens"]
    ours = tessera_logits(model, tokens, n, 64, None)
    report = compare(ours, ref, n, 64, 64)
    print(name, "decode max |Δlogit| =", report.decode_max_abs_diff, "prefill", report.prefill_max_abs_diff)
    assert report.decode >= 40
    assert report.decode_max_abs_diff <= TOLERANCE and report.prefill_max_abs_diff <= TOLERANCE
    assert report.top1_agreement == 1.0


def test_check_reference_cli_reports_json(tmp_path):
    import json
    import subprocess
    import sys

    model_dir = make_model(tmp_path / "m", "tiny", seed=4, with_tokenizer=False)
    out = subprocess.run([sys.executable, "-m", "tessera.engine.tools.commands", "check", "reference", "--model", str(model_dir),
                          "--tokens", "150", "--chunk", "37", "--decode", "5", "--json"],
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["max_abs_diff"] <= TOLERANCE and report["top1_agreement"] == 1.0
    assert {"prefill_max_abs_diff", "decode_max_abs_diff"} <= set(report)
