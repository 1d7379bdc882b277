"""Decode steps whose shape-stable parts are compiled with fixed shapes (engine/model/compiled.py,
StepCompiled, TESSERA_COMPILE_STEP) give the bits of the plain steps: sequences of different lengths
decoded together, greedy, step after step, the batch shrinking and growing again, then a step that mixes
decodes with a prefill chunk — identical logits and caches with the switch on and off, for plain float32
and official-format (mxfp8 projections, mxfp4 experts, bf16) weights, hash-routed and learned layers.
And each part is traced once per batch size, not once per step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import attention, compiled, moe
from tessera.kernels import shapeless
from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tests.support.env_switch import switch_in_fresh_process

OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
# Around the window (16), the top-k (16 rows = 64 tokens) and the HCA ratio (32): decoding crosses
# compressor emissions, so the compiled parts run beside every kind of cache update.
LENGTHS = (5, 62, 127, 31)
# Sequences decoding together, step by step: the batch shrinks, grows back, then runs alone.
BATCHES = ((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3), (1, 3), (1, 3), (0, 1, 2, 3), (2,), (2,))


@pytest.fixture(scope="module", params=["plain", "official"])
def model(request, tmp_path_factory):
    fmt = request.param
    path = make_model(tmp_path_factory.mktemp(f"step-{fmt}"), "tiny", seed=8, with_tokenizer=False, fmt=fmt, **OVERRIDES)
    return load_model(path, dtype="float32") if fmt == "plain" else load_model(path)  # official: bf16 as loaded


@pytest.fixture(autouse=True)
def _restore_switch():
    before = compiled.step_compile_enabled(), shapeless.compile_enabled()
    yield
    compiled.set_step_compile_enabled(before[0])
    shapeless.set_compile_enabled(before[1])


def _prefilled(model, length: int, seed: int):
    cache = model.new_cache()
    model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, length, seed))], tile=16)
    return cache


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def _run(model, enabled: bool, timer_factory=lambda: None):
    """Greedy decode in the BATCHES pattern, then one decode + prefill-chunk step -> (logits, cache arrays)."""
    compiled.set_step_compile_enabled(enabled)
    caches = [_prefilled(model, n, seed) for seed, n in enumerate(LENGTHS)]
    tokens, logits = [3 * b + 1 for b in range(len(caches))], []
    for batch in BATCHES:
        step = model.forward([Segment(caches[b], [tokens[b]]) for b in batch], timer=timer_factory())
        logits += [_bits(l) for l in step]
        for b, t in zip(batch, mx.argmax(mx.concatenate(step), axis=-1).tolist()):
            tokens[b] = int(t)
    newcomer = _prefilled(model, 9, seed=77)
    mixed = [Segment(c, [t]) for c, t in zip(caches, tokens)] + [Segment(newcomer, random_tokens(model.cfg.vocab_size, 20, 78))]
    logits += [_bits(l) for l in model.forward(mixed, tile=8, all_logits=True)]
    return logits, [_bits(a) for c in caches + [newcomer] for a in c.arrays()]


def _traces(model) -> list[tuple[int, ...]]:
    return [(p.attention_in.traces, *p.attention.traces, p.ffn_half.traces) for p in model._compiled_layers.values()]


def _assert_same(a, b):
    (a_logits, a_cache), (b_logits, b_cache) = a, b
    assert len(a_logits) == len(b_logits) and len(a_cache) == len(b_cache)
    for i, (x, y) in enumerate(zip(a_logits, b_logits)):
        assert x.shape == y.shape and np.array_equal(x, y), f"logits {i} differ"
    for i, (x, y) in enumerate(zip(a_cache, b_cache)):
        assert x.shape == y.shape and np.array_equal(x, y), f"cache array {i} differs"


def test_compiled_decode_steps_give_the_plain_bits_and_trace_once_per_batch_size(model):
    before_layers, before_head = _traces(model), model._compiled_head.traces
    on = _run(model, True)
    sizes = len({len(b) for b in BATCHES})  # 3: batches of 4, 2 and 1 rows
    # Each part of each layer: the attention prologue, attention's input projections and output, the FFN half
    assert [tuple(n - n0 for n, n0 in zip(t, t0)) for t, t0 in zip(_traces(model), before_layers)] == [(sizes,) * 4] * len(before_layers)
    # The head: every decode batch size, plus the prefills' one row (one segment each).
    assert model._compiled_head.traces - before_head == len({len(b) for b in BATCHES} | {1})
    off_before = _traces(model), model._compiled_head.traces
    off = _run(model, False)
    assert (_traces(model), model._compiled_head.traces) == off_before  # off: nothing traced
    _assert_same(on, off)
    compiled.set_step_compile_enabled(True)
    again = _traces(model)
    _assert_same(_run(model, True), off)  # replayed traces (no new ones) give the same bits
    assert _traces(model) == again


def test_the_stacked_inputs_switch_reaches_its_own_trace_of_the_attention_projections(model):
    """Stacked input projections decide which projections a layer's compiled attention inputs hand on (the
    compressors' kv and gate): flipping the switch in a running process must trace the inputs afresh, and
    both settings give the plain step's bits."""
    saved = attention.stacked_inputs_enabled()
    try:
        attention.set_stacked_inputs_enabled(True)
        _run(model, True)
        off = _run(model, False)
        attention.set_stacked_inputs_enabled(False)
        before = [p.attention.traces[0] for p in model._compiled_layers.values()]
        _assert_same(_run(model, True), off)
        sizes = len({len(b) for b in BATCHES})
        assert [p.attention.traces[0] - n for p, n in zip(model._compiled_layers.values(), before)] == [sizes] * len(before)
    finally:
        attention.set_stacked_inputs_enabled(saved)


def test_a_padded_moe_step_and_a_stage_synced_trace_run_the_parts_plain(model, monkeypatch):
    """A MoE that reads its counts back (padded layout) cannot be traced: the layer's FFN half runs plain
    while its attention prologue stays compiled; a stage-synced trace evaluates inside every part."""
    monkeypatch.setattr(moe, "PADDED_MIN_PAIRS_PER_EXPERT", 0)  # every decode batch runs the padded layout, one token too
    compiled.set_step_compile_enabled(False)
    off = _run(model, False)
    before = _traces(model)
    on = _run(model, True)
    assert [t[-1] for t in _traces(model)] == [t0[-1] for t0 in before]  # no FFN half traced (it would fail: a sync)
    _assert_same(on, off)
    monkeypatch.setattr(moe, "PADDED_MIN_PAIRS_PER_EXPERT", 12)
    before = _traces(model)
    _assert_same(_run(model, True, timer_factory=lambda: ForwardTrace(stage_sync=True)), off)
    assert _traces(model) == before


def test_flipping_the_shapeless_switch_traces_afresh(model):
    """A trace keeps the choices it was made with (the Sinkhorn kernel or reference, compiled or plain
    pieces): a switch flipped in a running process must reach a new trace."""
    compiled.set_step_compile_enabled(True)
    caches = [_prefilled(model, 12, seed=5)]
    step = lambda: mx.eval(model.forward([Segment(caches[0], [1])]))  # noqa: E731
    step()
    before = _traces(model)
    shapeless.set_compile_enabled(not shapeless.compile_enabled())
    step()
    assert all(n == n0 + 1 for t, t0 in zip(_traces(model), before) for n, n0 in zip(t, t0))


def test_moving_the_dense_threshold_traces_afresh(model):
    """The FFN half's shared expert is traced on the packed or the dequantized weights by the batch's rows
    (quantized.dense_min_rows): a threshold moved in a running process reaches a new trace of that part."""
    from tessera.engine.model import quantized

    compiled.set_step_compile_enabled(True)
    caches = [_prefilled(model, 12, seed=6)]
    step = lambda: mx.eval(model.forward([Segment(caches[0], [1])]))  # noqa: E731
    step()
    before, saved = _traces(model), quantized.dense_min_rows()
    quantized.set_dense_min_rows(1)
    try:
        step()
    finally:
        quantized.set_dense_min_rows(saved)
    assert all(t[-1] == t0[-1] + 1 for t, t0 in zip(_traces(model), before))


@pytest.mark.parametrize("value,expected", [("0", "False"), ("1", "True"), (None, "False")])
def test_environment_switch(value, expected):
    """Unset, it follows the device: off on this CPU."""
    assert switch_in_fresh_process(compiled.STEP_ENV_VAR, value, "tessera.engine.model.compiled", "step_compile_enabled") == expected


def test_unset_it_is_on_where_the_default_device_is_a_gpu(monkeypatch):
    monkeypatch.setattr(compiled, "_step_switch", None)  # as a process without TESSERA_COMPILE_STEP starts
    monkeypatch.setattr(compiled.mx, "default_device", lambda: mx.gpu)
    assert compiled.step_compile_enabled()
    monkeypatch.setattr(compiled.mx, "default_device", lambda: mx.cpu)
    assert not compiled.step_compile_enabled()
    compiled.set_step_compile_enabled(True)  # an explicit choice holds whatever the device
    assert compiled.step_compile_enabled()


@pytest.mark.parametrize("module, getter, setter", [
    ("sinkhorn", "kernel_enabled", "set_kernel_enabled"), ("sinkhorn", "warp_enabled", "set_warp_enabled"),
    ("row_gather", "kernel_enabled", "set_kernel_enabled"), ("gather_qmv", "kernel_enabled", "set_kernel_enabled"),
    ("gather_qmv", "mma_enabled", "set_mma_enabled"),
    ("mxfp8_qmv", "kernel_enabled", "set_kernel_enabled"), ("hc_mix", "kernel_enabled", "set_kernel_enabled"),
])
def test_a_kernel_switch_flipped_in_a_running_process_reaches_a_fresh_trace(module, getter, setter):
    """A trace replays the kernel choices it was traced with (compiled.StepCompiled): flipping a switch a
    step part reads (the benchmarks' A B B A arms) must trace the part again, not replay the old choice."""
    import importlib

    kernels = importlib.import_module(f"tessera.kernels.{module}")
    get, put = getattr(kernels, getter), getattr(kernels, setter)
    part, x, saved = compiled.StepCompiled(lambda a: a * 2), mx.ones((3,)), get()
    try:
        mx.eval(part(x), part(x))
        assert part.traces == 1
        put(not saved)
        mx.eval(part(x))
        assert part.traces == 2
    finally:
        put(saved)
