"""Batched decode is the single-sequence decode: sequences of different lengths decoded together
in one step give bit-identical logits (float32, MLX's bundled row-invariant BLAS) to each decoded
alone, step after step, and leave identical caches behind — decode steps evaluate once, with no
per-sequence or per-layer synchronisation (engine/model/attention.py), and the result must not move."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.cache import CompressorFrontier
from tessera.engine.model.compressor import CompressorWeights, compress, compress_decode
from tessera.engine.model.config import RopeSpec
from tessera.engine.model import attention, decode_attention
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.replay import random_tokens
from tests.equivalence.row_invariant_blas import row_invariant_blas
from tests.support.tiling_model import make_tiling_model

# Lengths below and above the window (16), top-k (16 rows = 64 tokens) and HCA boundaries (32); the
# 130, 129, 130 share their compressed-row counts at most steps, so they run as one batch per layer.
LENGTHS = (5, 31, 130, 64, 129, 130)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiling_model(tmp_path_factory.mktemp("batched"), seed=5), dtype="float32")


def _prefilled(model, length: int, seed: int):
    cache = model.new_cache()
    model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, length, seed))], tile=16)
    return cache


@row_invariant_blas
def test_batched_decode_equals_each_sequence_decoded_alone(model):
    steps = 6
    batched = [_prefilled(model, n, seed) for seed, n in enumerate(LENGTHS)]
    alone = [_prefilled(model, n, seed) for seed, n in enumerate(LENGTHS)]
    tokens = [[(7 * seed + 3 * s) % model.cfg.vocab_size for s in range(steps)] for seed in range(len(LENGTHS))]
    for s in range(steps):
        together = model.forward([Segment(c, [t[s]]) for c, t in zip(batched, tokens)])
        for b, (cache, t) in enumerate(zip(alone, tokens)):
            single = model.forward([Segment(cache, [t[s]])])[0]
            assert np.array_equal(np.array(together[b]), np.array(single)), (s, b)
    for a, b in zip(batched, alone):
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.contents(), b.contents()))


def _decode_step_logits(model, caches, tokens, prefill=None):
    """One step: a decode token for each cache, then (optionally) a prefill chunk (cache, tokens)."""
    segments = [Segment(c, [t]) for c, t in zip(caches, tokens)]
    if prefill is not None:
        segments.append(Segment(*prefill))
    return [np.array(l) for l in model.forward(segments, tile=8, all_logits=True)]


@row_invariant_blas
def test_batched_decode_rows_equal_the_per_sequence_tile_path(model, monkeypatch):
    """The batched decode path (engine/model/decode_attention.py) gives every decode row the bits of a
    one-row tile of the per-segment path, in a step that also runs a prefill chunk, with caches left
    identical."""
    runs = {}
    for batched in (True, False):
        monkeypatch.setattr(attention, "BATCH_DECODE_ROWS", batched)
        caches = [_prefilled(model, n, seed) for seed, n in enumerate(LENGTHS)]
        prefill_cache = _prefilled(model, 40, seed=99)
        chunk = random_tokens(model.cfg.vocab_size, 23, seed=98)
        logits = []
        for s in range(5):
            tokens = [(11 * b + 5 * s) % model.cfg.vocab_size for b in range(len(caches))]
            logits += _decode_step_logits(model, caches, tokens, (prefill_cache, chunk[s * 4 : s * 4 + 4]))
        runs[batched] = (logits, [a for c in caches + [prefill_cache] for a in c.contents()])
    (got, got_cache), (want, want_cache) = runs[True], runs[False]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert len(got_cache) == len(want_cache)
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(got_cache, want_cache))


def test_decode_rows_attend_in_one_call_per_layer_and_shape(model, monkeypatch):
    """B sequences with the same compressed-row counts cost one mixed-attention call per layer, not B;
    sequences whose counts differ split into one call per count in HCA layers, and in CSA layers only
    where fewer than top_k rows (16) exist: there min(top_k, N) is the attended rows' shape."""
    calls = []
    real = decode_attention.decode_mixed_attention
    monkeypatch.setattr(decode_attention, "decode_mixed_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    same = [_prefilled(model, 130, seed) for seed in range(4)]
    model.forward([Segment(c, [3]) for c in same])
    assert calls == [4] * model.cfg.num_hidden_layers
    calls.clear()
    mixed = [_prefilled(model, n, seed) for seed, n in enumerate((130, 130, 64))]  # 64 + 1 tokens: fewer rows
    model.forward([Segment(c, [3]) for c in mixed])
    assert calls == [3, 3, 2, 1, 3]  # window; CSA (N 32, 32, 16 ≥ top_k); HCA (N 4, 4, 2); CSA
    calls.clear()
    short = [_prefilled(model, n, seed) for seed, n in enumerate((130, 40))]  # 40 + 1 tokens: 10 < top_k CSA rows
    model.forward([Segment(c, [3]) for c in short])
    assert calls == [2, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("ratio,overlapping", [(4, True), (8, False)], ids=["CSA", "HCA"])
@row_invariant_blas
def test_batched_compressor_update_equals_each_token_alone(ratio, overlapping):
    """Sequences at every phase of a compression window take one token each: the rows emitted and
    the frontiers left behind are the bits of `compress` on each token alone (some windows close
    while others stay open in the same step, several close at once)."""
    rng = np.random.default_rng(ratio)
    hidden, head_dim = 16, 8
    width = 2 * head_dim if overlapping else head_dim
    f32 = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    weights = CompressorWeights(f32(width, hidden), f32(width, hidden), f32(ratio, width), f32(head_dim) + 1.0)
    rope, eps = RopeSpec(theta=10000.0, dim=4), 1e-6
    prefixes = [0, 1, ratio - 1, ratio, 2 * ratio + 1, ratio - 1]
    batched = [CompressorFrontier() for _ in prefixes]
    for i, n in enumerate(prefixes):
        if n:
            _, batched[i] = compress(f32(n, hidden), weights, batched[i], ratio, overlapping, rope, eps)
    alone = list(batched)  # frontiers are values: both sides start from the same ones, neither can write them
    emitted_per_step = []
    for _ in range(2 * ratio + 1):
        x = f32(len(prefixes), hidden)
        got, batched = compress_decode(x, weights, batched, ratio, overlapping, rope, eps)
        emitted_per_step.append(sum(row is not None for row in got))
        for i, frontier in enumerate(alone):
            want, alone[i] = compress(x[i : i + 1], weights, frontier, ratio, overlapping, rope, eps)
            if want.shape[0] == 0:
                assert got[i] is None, i
            else:
                assert np.array_equal(np.array(got[i]), np.array(want)), i
    for fb, fa in zip(batched, alone):
        assert (fb.num_emitted, fb.num_open) == (fa.num_emitted, fa.num_open)
        assert len(fb.contents()) == len(fa.contents())
        assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(fb.contents(), fa.contents()))
    assert max(emitted_per_step) >= 2 and any(0 < e < len(prefixes) for e in emitted_per_step)


# Which sequences step together changes between steps in a served batch: one pauses, another joins
# fresh from its prefill, the order moves. Steps are lists of indices into STAGGERED's sequences.
STAGGERED = (130, 131, 140, 64, 20, 129)
COMPOSITIONS = ([0, 1, 2, 3], [2, 0, 3], [1, 3, 4, 0, 2], [4, 1], [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5])


@pytest.mark.parametrize("stacked_gather", [True, False], ids=["stacked-gather", "per-sequence-gather"])
@row_invariant_blas
def test_sequences_joining_leaving_and_reordering_between_steps_stay_exact(model, monkeypatch, stacked_gather):
    """The window and compressor state a decode step leaves are rows of that step's arrays, taken back
    whole only by the same sequences in the same order (cache.stacked); any other batch regathers them.
    Every composition below must give each sequence the bits of decoding it alone, with the selected
    rows gathered from the stacked buffers or from each buffer (decode_attention.STACKED_GATHER_BYTES)."""
    monkeypatch.setattr(decode_attention, "STACKED_GATHER_BYTES", decode_attention.STACKED_GATHER_BYTES if stacked_gather else 0)
    batched = [_prefilled(model, n, seed) for seed, n in enumerate(STAGGERED)]
    alone = [_prefilled(model, n, seed) for seed, n in enumerate(STAGGERED)]
    for s, members in enumerate(COMPOSITIONS):
        tokens = [(13 * b + 7 * s) % model.cfg.vocab_size for b in members]
        together = model.forward([Segment(batched[b], [t]) for b, t in zip(members, tokens)])
        for row, (b, t) in enumerate(zip(members, tokens)):
            single = model.forward([Segment(alone[b], [t])])[0]
            assert np.array_equal(np.array(together[row]), np.array(single)), (s, b)
    for a, b in zip(batched, alone):
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.contents(), b.contents()))


@row_invariant_blas
def test_rewinding_a_batched_step_restores_the_exact_state_from_references(model):
    """The runner's failed-step snapshot (cache.resume_state) holds the window and frontiers themselves,
    not copies — they are values the model replaces, never writes — and rewinding to it makes the
    re-run step give the same bits as the first attempt."""
    from tessera.engine.model.cache import resume_state, rewind

    caches = [_prefilled(model, n, seed) for seed, n in enumerate(STAGGERED[:4])]
    model.forward([Segment(c, [5]) for c in caches])  # the state to snapshot is a batched step's
    states = [resume_state(c) for c in caches]
    for cache, state in zip(caches, states):
        for layer, saved in zip(cache.layers, state.layers):
            assert saved.compressor is layer.compressor and saved.indexer_compressor is layer.indexer_compressor
            assert saved.window is layer.stored_window
    first = [np.array(l) for l in model.forward([Segment(c, [9]) for c in caches])]
    for cache, state in zip(caches, states):
        rewind(cache, state)
    again = [np.array(l) for l in model.forward([Segment(c, [9]) for c in caches])]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
