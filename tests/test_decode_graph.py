"""The decode rows of a step add a handful of graph nodes per sequence, not a copy of the per-layer
work: the window and compressor updates, the HCA rows and the selected-row gather of all sequences are
a few ops per layer whatever the batch (engine/model/decode_attention.py, compressor.compress_decode,
cache.Stacked). What remains per sequence is reading its own cache buffers for the indexer and
appending the rows its token completed (docs/BENCHMARKS.md "Issue 14, session 6")."""

from __future__ import annotations

import collections
import re

import mlx.core as mx

from tessera.engine.model import attention
from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens

OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
# Nodes per extra sequence and step, the four layers' decode attention together (the mean over four
# steps, one of which closes every CSA window). Measured: 5.5 with this change, 70 before it.
MAX_NODES_PER_SEQUENCE = 8


def _nodes(arrays, path) -> int:
    mx.export_to_dot(str(path), *arrays)
    return sum(collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', path.read_text())).values())


def test_decode_attention_adds_few_graph_nodes_per_sequence(tmp_path, monkeypatch):
    model = load_model(make_model(tmp_path / "m", "tiny", seed=2, with_tokenizer=False, **OVERRIDES), dtype="float32")
    real = attention.decode_attention
    counted = []

    def counting(rows, w, cfg, layer, timer):
        """Evaluates the inputs first, so only the graph decode_attention builds is counted."""
        inputs = [a for a in (rows.x, rows.kv, rows.q, rows.index_q, rows.index_w) if a is not None]
        mx.eval(inputs, [s.cache.arrays() for s in rows.segments])
        out = real(rows, w, cfg, layer, timer)
        counted.append(_nodes([out] + [a for s in rows.segments for a in s.cache.arrays()], tmp_path / "layer.dot"))
        return out

    def step_nodes(batch: int) -> float:
        caches = []
        for seed in range(batch):
            cache = model.new_cache()
            model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, 130, seed))], tile=16)
            caches.append(cache)
        model.forward([Segment(c, [1]) for c in caches])  # the same sequences stepped together before
        counted.clear()
        for s in range(4):  # one CSA window (ratio 4) closes in one of these steps
            mx.eval(model.forward([Segment(c, [2 + s]) for c in caches]), [c.arrays() for c in caches])
        return sum(counted) / 4

    monkeypatch.setattr(attention, "decode_attention", counting)
    per_sequence = (step_nodes(12) - step_nodes(4)) / 8
    assert per_sequence <= MAX_NODES_PER_SEQUENCE, per_sequence
