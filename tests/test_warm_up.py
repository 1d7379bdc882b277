"""The decode warm-up (engine/serving/warm_up.py): with the step compile on, it traces the compiled step parts
for every batch size it is given, so later decode steps at those sizes trace nothing; it leaves no state a
user could see (the same logits bits as a model never warmed up); `build_engine` runs it over
1..max_num_seqs only when the switch is on."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import compiled
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment
from tessera.engine.model.loader import load_model
from tessera.engine.serving import factory
from tessera.engine.serving.factory import EngineOptions, build_engine
from tessera.engine.serving.warm_up import warm_up_decode
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("warm-up"), "tiny", seed=4, with_tokenizer=False)


@pytest.fixture(autouse=True)
def _restore_switch():
    before = compiled.step_compile_enabled()
    yield
    compiled.set_step_compile_enabled(before)


def _traces(model: DeepseekV4) -> int:
    """Traces of every compiled step part so far (compiled.StepCompiled.traces)."""
    layers = sum(p.attention_in.traces + p.ffn_half.traces for p in model._compiled_layers.values())
    return layers + model._compiled_head.traces


def _decode_step(model: DeepseekV4, batch_size: int) -> None:
    """One decode step of `batch_size` fresh sequences that each hold a short prompt."""
    caches = [model.new_cache() for _ in range(batch_size)]
    for seed, cache in enumerate(caches):
        model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, 3 + seed, seed))])
    mx.eval(model.forward([Segment(cache, [5 + b]) for b, cache in enumerate(caches)]))


def test_warmed_up_batch_sizes_trace_nothing_new_and_others_still_trace(model_dir):
    compiled.set_step_compile_enabled(True)
    model = load_model(model_dir, dtype="float32")
    warm_up = warm_up_decode(model, [1, 2, 3])
    assert [b for b, _ in warm_up.seconds] == [1, 2, 3] and warm_up.total_seconds > 0
    warmed = _traces(model)
    assert warmed > 0
    for batch_size in (1, 2, 3):
        _decode_step(model, batch_size)
    assert _traces(model) == warmed
    _decode_step(model, 4)  # not warmed up: the check above can see a trace
    assert _traces(model) > warmed


def _greedy_logits(model: DeepseekV4) -> list[np.ndarray]:
    """A prompt then a few greedy decode steps of one sequence: every step's logits as uint32 bits."""
    cache = model.new_cache()
    logits = model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, 11, 9))])[0]
    bits = [np.array(logits).view(np.uint32)]
    for _ in range(4):
        logits = model.forward([Segment(cache, [int(mx.argmax(logits[-1]).item())])])[0]
        bits.append(np.array(logits).view(np.uint32))
    return bits


def test_the_warm_up_changes_no_output(model_dir):
    compiled.set_step_compile_enabled(True)
    warmed = load_model(model_dir, dtype="float32")
    warm_up_decode(warmed, [1, 2])
    fresh = load_model(model_dir, dtype="float32")
    for a, b in zip(_greedy_logits(warmed), _greedy_logits(fresh), strict=True):
        assert np.array_equal(a, b)


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("warm-up-served"), "tiny", seed=4, with_tokenizer=True)


def _built_model(served_dir, monkeypatch) -> DeepseekV4:
    """build_engine with max_num_seqs=2 -> the model its runner holds."""
    runners = []

    def recording_build_runner(*args, **kwargs):
        runners.append(factory_build_runner(*args, **kwargs))
        return runners[-1]

    factory_build_runner = factory.build_runner
    monkeypatch.setattr(factory, "build_runner", recording_build_runner)
    build_engine(EngineOptions(served_dir, prefill_chunk=64, indexer_tile=64, max_context=256, stage_timing_interval=0,
                               max_num_seqs=2, max_queued_requests=2, memory_budget=None))
    return runners[0].model


def test_build_engine_warms_up_batch_sizes_up_to_max_num_seqs_with_the_switch_on(served_dir, monkeypatch, caplog):
    compiled.set_step_compile_enabled(True)
    with caplog.at_level(logging.INFO, logger=factory.logger.name):
        model = _built_model(served_dir, monkeypatch)
    said = [r.getMessage() for r in caplog.records]
    # Announced before it runs (minutes on a fresh GPU machine), and what it took after.
    start = next(i for i, m in enumerate(said) if m.startswith("decode warm-up: one step at each batch size 1..2"))
    assert any(m.startswith("decode warm-up took") for m in said[start + 1 :])
    # One trace per batch size (1 and 2) of every layer part and of the head.
    parts = [t for p in model._compiled_layers.values() for t in (p.attention_in.traces, p.ffn_half.traces)]
    assert parts == [2] * len(parts) and model._compiled_head.traces == 2


def test_build_engine_runs_no_warm_up_with_the_switch_off(served_dir, monkeypatch):
    compiled.set_step_compile_enabled(False)
    # A warm-up with the switch off would trace nothing either: count its calls, not only the traces.
    calls = []
    monkeypatch.setattr(factory, "warm_up_decode", lambda *args: calls.append(args))
    assert _traces(_built_model(served_dir, monkeypatch)) == 0 and calls == []
