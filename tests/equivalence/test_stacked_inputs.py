"""A layer's input projections stacked into one matmul per storage format (attention_inputs.StackedInputs,
TESSERA_STACKED_INPUTS): decode steps give the bits of one matmul per projection — sequences of different
lengths decoded together across compressor emissions, then a step mixing decodes with a prefill chunk — for
plain float32 and official-format weights (mxfp8 q_a and kv; bf16 index head weights and compressors); the
model keeps one copy of those weights; and a decode step launches fewer matmuls. Bit equality needs a BLAS
whose dot products do not depend on the matrix's other columns (MLX's bundled one; OpenBLAS's gemm blocks
differ with the width): the comparison reruns without LD_PRELOAD (row_invariant_blas)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import attention
from tessera.engine.model.attention_inputs import INPUT_PROJECTIONS, projection_weight
from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.model.quantized import QuantizedWeight, weight_arrays
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tests.equivalence.row_invariant_blas import row_invariant_blas
from tests.support.env_switch import switch_in_fresh_process
from tests.support.graph_nodes import primitive_kinds

OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
LENGTHS = (5, 62, 127, 31)  # around the window (16), the top-k (16 rows) and the HCA ratio (32)
STEPS = 6  # crosses CSA emissions (ratio 4) in every sequence


@pytest.fixture(scope="module", params=["plain", "official"])
def model(request, tmp_path_factory):
    fmt = request.param
    path = make_model(tmp_path_factory.mktemp(f"stacked-{fmt}"), "tiny", seed=4, with_tokenizer=False, fmt=fmt, **OVERRIDES)
    return load_model(path, dtype="float32") if fmt == "plain" else load_model(path)


@pytest.fixture(autouse=True)
def _restore_switch():
    before = attention.stacked_inputs_enabled()
    yield
    attention.set_stacked_inputs_enabled(before)


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def _run(model, stacked: bool):
    """Greedy decode of every sequence together, then one decode + prefill-chunk step -> (logits, cache arrays)."""
    attention.set_stacked_inputs_enabled(stacked)
    caches = []
    for seed, n in enumerate(LENGTHS):
        cache = model.new_cache()
        model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, n, seed))], tile=16)
        caches.append(cache)
    tokens, logits = [3 * b + 1 for b in range(len(caches))], []
    for _ in range(STEPS):
        step = model.forward([Segment(c, [t]) for c, t in zip(caches, tokens)])
        logits += [_bits(l) for l in step]
        tokens = [int(t) for t in mx.argmax(mx.concatenate(step), axis=-1).tolist()]
    newcomer = model.new_cache()
    model.forward([Segment(newcomer, random_tokens(model.cfg.vocab_size, 9, 77))])
    mixed = [Segment(c, [t]) for c, t in zip(caches, tokens)] + [Segment(newcomer, random_tokens(model.cfg.vocab_size, 20, 78))]
    logits += [_bits(l) for l in model.forward(mixed, tile=8, all_logits=True)]
    return logits, [_bits(a) for c in caches + [newcomer] for a in c.arrays()]


@row_invariant_blas
def test_stacked_input_projections_give_the_bits_of_one_matmul_each(model):
    on, off = _run(model, True), _run(model, False)
    for kind, a, b in (("logits", on[0], off[0]), ("cache", on[1], off[1])):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.shape == y.shape and np.array_equal(x, y), f"{kind} {i} differs"


def test_each_storage_format_is_one_stacked_weight_and_the_only_copy(model):
    official = any(isinstance(w, QuantizedWeight) for w in model.weights.values())
    for i, layer in model.layers.items():
        attn = layer.attn
        groups = attn.stacked_inputs.groups
        parts = [p for g in groups for p in g.parts]
        assert sorted(parts, key=INPUT_PROJECTIONS.index) == [n for n in INPUT_PROJECTIONS if projection_weight(attn, n) is not None]
        # official: mxfp8 q_a and kv in one group, the bf16 rest in another; plain: one float32 group
        assert len(groups) == (1 if model.cfg.layer_types[i] == WINDOW or not official else 2)
        p = f"layers.{i}.attn."
        assert model.weights[p + "wq_a.weight"] is attn.wq_a and model.weights[p + "wkv.weight"] is attn.wkv
        for group in groups:
            start = 0
            for name, width in zip(group.parts, group.widths):
                rows = _arrays(group.weight, start, start + width)
                assert all(mx.array_equal(r, v).item() for r, v in zip(rows, _arrays(projection_weight(attn, name))))
                start += width
            assert start == _arrays(group.weight)[0].shape[0]


def test_a_decode_step_launches_one_matmul_per_format_and_layer(model, tmp_path):
    """Tiny's layers [window, CSA, HCA, CSA]: stacked, a window layer's 2 input projections are 1 matmul, a
    CSA layer's 7 are 2 (official) or 1, an HCA layer's 4 are 2 or 1."""
    official = any(isinstance(w, QuantizedWeight) for w in model.weights.values())

    def matmuls(stacked: bool) -> int:
        """Matmul nodes of one decode step's graph (a sequence of 40 tokens, fresh each time)."""
        attention.set_stacked_inputs_enabled(stacked)
        cache = model.new_cache()
        mx.eval(model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, 40, 1))], tile=16))
        out = model.forward([Segment(cache, [5])])
        kinds = primitive_kinds([*out, *cache.arrays()], tmp_path / "step.dot")
        return sum(v for k, v in kinds.items() if k in ("Matmul", "QuantizedMatmul"))

    saved = (2 - 1) + (7 - 1) + (4 - 1) + (7 - 1) if not official else (2 - 1) + (7 - 2) + (4 - 2) + (7 - 2)
    assert matmuls(False) - matmuls(True) == saved


@pytest.mark.parametrize("value,expected", [("0", "False"), ("1", "True"), (None, "True")])
def test_environment_switch(value, expected):
    assert switch_in_fresh_process("TESSERA_STACKED_INPUTS", value, "tessera.engine.model.attention",
                                   "stacked_inputs_enabled") == expected


def _arrays(w, start: int = 0, stop: int | None = None) -> list[mx.array]:
    return [a[start:stop] for a in weight_arrays(w)]
