"""The device-against-CPU part of `check gpu` (engine/tools/device_agreement.py): its premise (nothing
discrete can flip: every layer hash-routed, every CSA row within the indexer's top-k), what it reports,
and that a layer computing something else shows up alone, at that layer. On this CPU the "device" is the
CPU too, so every difference is 0.0; on a CUDA machine `check gpu` runs it against the GPU."""

from __future__ import annotations

import json
from functools import partial

import mlx.core as mx
import pytest

from tessera.engine.model.config import CSA, HASH_MOE, HCA
from tessera.engine.model.loader import load_config, load_model
from tessera.engine.tools.check_limits import DEVICE_AGREEMENT_MAX_REL_DIFF
from tessera.engine.tools.device_agreement import (
    DECODE_TOKEN, LAYER_TYPES, PROMPT_LENGTHS, AgreementRow, LayerStep, check_device_agreement, compare_prompt,
    evaluated_on, make_agreement_model,
)
from tessera.engine.tools.replay import random_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_agreement_model(tmp_path_factory.mktemp("agreement") / "m")


def test_nothing_discrete_can_flip_in_the_agreement_model(model_dir):
    cfg = load_config(model_dir)
    assert set(cfg.mlp_layer_types) == {HASH_MOE}  # no learned expert choice
    csa_ratio, hca_ratio = (cfg.compress_ratio(cfg.layer_types.index(kind)) for kind in (CSA, HCA))
    assert (max(PROMPT_LENGTHS) + 1) // csa_ratio <= cfg.index_topk  # the indexer keeps every row, decode included
    assert min(PROMPT_LENGTHS) < csa_ratio and max(PROMPT_LENGTHS) > hca_ratio  # before and after the first rows


def test_the_cpu_agrees_with_itself_in_every_layer_and_the_logits(model_dir):
    rows = check_device_agreement(model_dir, device=mx.cpu, reference=mx.cpu)
    layers = load_config(model_dir).num_hidden_layers
    assert len(rows) == len(PROMPT_LENGTHS) * 2 * (layers + 1)  # the prompt, then one decoded token
    assert [r.part for r in rows[: 2 * (layers + 1)]][layers :: layers + 1] == ["logits", "decode logits"]
    assert all(r.rel_diff == 0.0 for r in rows) and {r.checkpoint for r in rows} == {"plain"}


def test_a_layer_that_computes_something_else_shows_alone(model_dir):
    model = load_model(model_dir, dtype="float32")
    target = model.layer_ids[2]

    def wrong_on_device(step, model, streams, segments):
        out = evaluated_on(mx.cpu, step, model, streams, segments)
        return out * 1.5 if step == LayerStep(target) else out

    rows = compare_prompt(model, random_tokens(model.cfg.vocab_size, 5, 0), wrong_on_device,
                          partial(evaluated_on, mx.cpu))
    over = [r.part for r in rows if r.rel_diff > DEVICE_AGREEMENT_MAX_REL_DIFF]
    name = f"layer {target} ({model.cfg.layer_types[target]})"
    assert over == [name, f"decode {name}"]  # the next layers start from the CPU's input


def test_the_decoded_token_continues_each_sides_prompt(model_dir):
    """The decode step runs on the caches the prompt filled, on both sides: one token after the prompt's."""
    model = load_model(model_dir, dtype="float32")
    seen = []

    def recording(side):
        def run(step, model, streams, segments):
            seen.append((side, [(s.cache.num_tokens, list(s.token_ids)) for s in segments]))
            return evaluated_on(mx.cpu, step, model, streams, segments)
        return run

    compare_prompt(model, random_tokens(model.cfg.vocab_size, 5, 0), recording("device"), recording("reference"))
    decode = [(side, segs) for side, segs in seen if segs == [(5, [DECODE_TOKEN])]]
    assert {side for side, _ in decode} == {"device", "reference"}
    assert len(decode) == 2 * (model.cfg.num_hidden_layers + 1) + 1  # every layer and the head on both, the embedding



def test_the_official_format_runs_its_quantized_experts_and_agrees_on_the_cpu(tmp_path):
    """The official checkpoint's routed experts run gather_qmm (another device kernel than the plain
    checkpoint's gather_mm): `check gpu` compares both formats."""
    from tessera.engine.model.quantized import QuantizedWeight

    model_dir = make_agreement_model(tmp_path / "official", "official")
    model = load_model(model_dir, dtype="float32")
    assert isinstance(model.layers[0].ffn.w1, QuantizedWeight)
    rows = check_device_agreement(model_dir, device=mx.cpu, reference=mx.cpu, lengths=(5,))
    assert {r.checkpoint for r in rows} == {"official"} and all(r.rel_diff == 0.0 for r in rows)


def test_check_agreement_compares_both_formats_and_refuses_to_pass_without_a_device(tmp_path, capsys):
    from tessera.engine.tools import commands

    if mx.default_device() == mx.gpu:
        pytest.skip("a GPU is the default device")
    assert commands.main(["check", "agreement"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    out = tmp_path / "agreement.json"
    assert commands.main(["check", "agreement", "--allow-cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| official | 62 | logits | 0 | yes |" in printed and "| official | 62 | decode logits | 0 | yes |" in printed
    assert printed.rstrip().endswith("no violations")
    report = json.loads(out.read_text())
    layers = len(LAYER_TYPES)  # two formats, each prompt and its decoded token
    assert len(report["rows"]) == 2 * len(PROMPT_LENGTHS) * 2 * (layers + 1) and report["violations"] == []


def test_check_agreement_fails_past_the_limit(monkeypatch, capsys):
    from tessera.engine.tools import commands, device_agreement

    rows = [AgreementRow("plain", 5, "layer 0 (sliding_attention)", 0.78), AgreementRow("plain", 5, "logits", 3e-7)]
    monkeypatch.setattr(device_agreement, "check_device_agreement", lambda *a, **k: rows)
    assert commands.main(["check", "agreement", "--allow-cpu"]) == 1
    out = capsys.readouterr().out
    assert "| plain | 5 | layer 0 (sliding_attention) | 0.78 | **NO** |" in out
    assert "VIOLATION: device vs CPU: plain checkpoint, prompt of 5, layer 0 (sliding_attention): relative difference 0.78" in out
