"""Batched decode is the single-sequence decode: sequences of different lengths decoded together
in one step give bit-identical logits (float32, MLX's bundled row-invariant BLAS) to each decoded
alone, step after step, and leave identical caches behind — decode steps evaluate once, with no
per-sequence or per-layer synchronisation (engine/model/attention.py), and the result must not move."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.model.config import CSA, HCA, WINDOW
from engine.model.deepseek_v4 import Segment
from engine.model.loader import load_model
from engine.tools.make_model import make_model
from engine.tools.replay import random_tokens
from tests.equivalence.row_invariant_blas import row_invariant_blas

OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
# Lengths below and above the window (16), top-k (16 rows = 64 tokens) and HCA boundaries (32).
LENGTHS = (5, 31, 64, 130)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_model(tmp_path_factory.mktemp("batched"), "tiny", seed=5, with_tokenizer=False, **OVERRIDES), dtype="float32")


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
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.arrays(), b.arrays()))
