"""Decode steps that start each layer on the device as soon as it is built (engine/model/decode_async.py,
TESSERA_DECODE_ASYNC: inline, or handed to the encode thread) give the bits of steps evaluated whole:
sequences of different lengths decoded together, greedy, step after step, then a step that mixes decodes
with a prefill chunk — identical logits and identical caches in every mode. Only the evaluation order
and the thread that encodes may change."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import decode_async, encode_thread
from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tests.support.env_switch import switch_in_fresh_process

OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
# Around the window (16), the top-k (16 rows = 64 tokens) and the HCA ratio (32): decoding crosses
# compressor emissions, so cache rows written by one started layer are read by later steps.
LENGTHS = (5, 62, 127, 31)
STEPS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_model(tmp_path_factory.mktemp("async"), "tiny", seed=8, with_tokenizer=False, **OVERRIDES), dtype="float32")


@pytest.fixture(autouse=True)
def _restore_switch():
    before = decode_async.decode_async_mode()
    yield
    decode_async.set_decode_async_mode(before)


def _prefilled(model, length: int, seed: int):
    cache = model.new_cache()
    model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, length, seed))], tile=16)
    return cache


def _run(model, monkeypatch, mode: str, timer_factory=lambda: None):
    """Greedy batched decode, then one decode + prefill-chunk step -> (logits, cache arrays, layers started
    early by the decode-only steps: {"inline": `mx.async_eval` calls in this thread, "thread": hand-overs
    to the encode thread})."""
    decode_async.set_decode_async_mode(mode)
    caches = [_prefilled(model, n, seed) for seed, n in enumerate(LENGTHS)]
    calls: dict[str, list[int]] = {"inline": [], "thread": []}
    real_eval, real_submit = mx.async_eval, encode_thread.EncodeThread.submit
    caller = threading.current_thread()

    def counted_eval(*arrays):  # this thread's only: the encode thread's own calls are its hand-overs
        if threading.current_thread() is caller:
            calls["inline"].append(len(arrays))
        return real_eval(*arrays)

    monkeypatch.setattr(mx, "async_eval", counted_eval)
    monkeypatch.setattr(encode_thread.EncodeThread, "submit", lambda self, arrays: (calls["thread"].append(len(arrays)), real_submit(self, arrays))[1])
    tokens, logits = [3 * b + 1 for b in range(len(caches))], []
    for _ in range(STEPS):
        step = model.forward([Segment(c, [t]) for c, t in zip(caches, tokens)], timer=timer_factory())
        logits += [np.array(l) for l in step]
        tokens = [int(t) for t in mx.argmax(mx.concatenate(step), axis=-1).tolist()]
    decode_calls = {k: len(v) for k, v in calls.items()}
    monkeypatch.setattr(mx, "async_eval", real_eval)
    monkeypatch.setattr(encode_thread.EncodeThread, "submit", real_submit)
    newcomer = _prefilled(model, 9, seed=77)
    mixed = [Segment(c, [t]) for c, t in zip(caches, tokens)] + [Segment(newcomer, random_tokens(model.cfg.vocab_size, 20, 78))]
    logits += [np.array(l) for l in model.forward(mixed, tile=8, all_logits=True)]
    arrays = [np.array(a) for c in caches + [newcomer] for a in c.arrays()]
    return logits, arrays, decode_calls


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_decode_steps_give_the_same_bits_with_layers_started_early_or_not(model, monkeypatch, mode):
    on_logits, on_cache, on_calls = _run(model, monkeypatch, mode)
    off_logits, off_cache, off_calls = _run(model, monkeypatch, "off")
    assert on_calls[mode] == STEPS * model.cfg.num_hidden_layers  # every layer of every decode step started early
    if mode == "thread":  # and one call a step here: the step's inputs built elsewhere, queued before the layers
        assert on_calls["inline"] == STEPS
    assert off_calls == {"inline": 0, "thread": 0}
    assert len(on_logits) == len(off_logits) and len(on_cache) == len(off_cache)
    for i, (a, b) in enumerate(zip(on_logits, off_logits)):
        assert np.array_equal(a, b), f"logits {i} differ"
    for i, (a, b) in enumerate(zip(on_cache, off_cache)):
        assert a.shape == b.shape and np.array_equal(a, b), f"cache array {i} differs"


def test_the_first_decode_step_of_a_model_is_not_handed_to_the_thread(tmp_path, monkeypatch):
    """Its graph building makes the layers' lazily evaluated weights (an evaluation in this thread)."""
    fresh = load_model(make_model(tmp_path, "tiny", seed=8, with_tokenizer=False, **OVERRIDES), dtype="float32")
    caches = [_prefilled(fresh, n, seed) for seed, n in enumerate(LENGTHS[:2])]
    decode_async.set_decode_async_mode("thread")
    handed: list[int] = []
    real_submit = encode_thread.EncodeThread.submit
    monkeypatch.setattr(encode_thread.EncodeThread, "submit", lambda self, arrays: (handed.append(1), real_submit(self, arrays))[1])
    for step in range(2):
        mx.eval(fresh.forward([Segment(c, [1]) for c in caches]))
        assert len(handed) == step * fresh.cfg.num_hidden_layers


def test_an_error_on_the_thread_reaches_the_caller(monkeypatch):
    thread = encode_thread.EncodeThread(mx.default_device())
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: (_ for _ in ()).throw(RuntimeError("encode failed")))
    thread.submit([mx.array([1.0])])
    with pytest.raises(RuntimeError, match="encode failed"):
        thread.drain()
    monkeypatch.undo()
    thread.submit([mx.array([2.0])])
    thread.drain()  # the error was handed over once; the thread goes on


def test_stage_synced_decode_does_not_start_layers_early(model, monkeypatch):
    """A stage-synced trace evaluates every stage anyway: nothing is left to overlap."""
    for mode in ("inline", "thread"):
        _, _, calls = _run(model, monkeypatch, mode, timer_factory=lambda: ForwardTrace(stage_sync=True))
        assert calls == {"inline": 0, "thread": 0}


@pytest.mark.parametrize("value,expected", [("0", "off"), ("1", "inline"), ("thread", "thread"), (None, "off")])
def test_environment_switch(value, expected):
    assert switch_in_fresh_process(decode_async.ENV_VAR, value, "tessera.engine.model.decode_async", "decode_async_mode") == expected


def test_a_step_that_fails_while_built_leaves_nothing_on_the_thread(model, monkeypatch):
    """The caller may evaluate (and the runner does, undoing the step) as soon as the failure reaches it."""
    decode_async.set_decode_async_mode("thread")
    caches = [_prefilled(model, n, seed) for seed, n in enumerate(LENGTHS[:2])]
    mx.eval(model.forward([Segment(c, [1]) for c in caches]))  # the model has decoded: the thread applies
    drained: list[int] = []
    real_drain = encode_thread.EncodeThread.drain
    monkeypatch.setattr(encode_thread.EncodeThread, "drain", lambda self: (drained.append(1), real_drain(self))[1])
    monkeypatch.setattr(model, "logits", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("head failed")))
    with pytest.raises(RuntimeError, match="head failed"):
        model.forward([Segment(c, [2]) for c in caches])
    assert drained == [1]
