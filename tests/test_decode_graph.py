"""The decode rows of a step add a handful of graph nodes per sequence, not a copy of the per-layer
work: the window and compressor updates, the HCA rows and the selected-row gather of all sequences are
a few ops per layer whatever the batch (engine/model/decode_attention.py, compressor.compress_decode,
cache.Stacked). What remains per sequence is appending the rows its token completed and, without the
CUDA kernels, reading its own buffers' views (docs/BENCHMARKS.md "Issue 14, session 6" and "session 7")."""

from __future__ import annotations


import mlx.core as mx
import pytest

from docs.bench.cuda_standin import cuda_graph_on_cpu, standin_kernel
from tessera.engine.model import attention
from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tessera.kernels import indexer_cuda, row_gather
from tests.support.graph_nodes import primitive_kinds

OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
# Nodes per extra sequence and step, the four layers' decode attention together (the mean over four
# steps, one of which closes every CSA window). Measured on the CPU's path: 3.5 since the indexer
# concatenates the memoized [1, N, d] views (5.5 when it stacked the [N, d] views, 70 before session 6).
MAX_NODES_PER_SEQUENCE = 4
# The same on the CUDA path (the kernels as one node each): 2.0, the appends of the closing step (a
# row cut out of the pooled batch and written into the sequence's buffer, for 4 buffers, every 4 steps).
MAX_NODES_PER_SEQUENCE_ON_CUDA = 2
# A whole decode step of one sequence on the CUDA path (docs/bench/cuda_standin.py), the tiny preset: the ordinary
# step and the one that closes the CSA windows, in float32 and as an official checkpoint (FP8/FP4) in bf16, a GPU's
# path (its casts, the quantized projections). MLX's CUDA backend pays a host cost per node, so a node more is a
# step slower on a GPU (docs/BENCHMARKS.md, "Session 34"). The counts at session 36. Float32: 585 and 705 before
# session 34 (the router's transposed operand, the RoPE tables met as they are, one token's output groups
# reshaped), 565 and 677 before session 35 (the Sinkhorn kernel's eps add, cast and transposed write; the top-k
# kernel's validity; the HCA mask made once). Official bf16: 595 and 715 before session 35 (the same, and
# gather_qmm's lhs indices). 539 / 651 and 557 / 677 before session 36 (each collapse after its mix logits one
# kernel, the head's too: kernels/hc_collapse.py). 476 / 588 and 476 / 596 before session 37 (each expand one kernel,
# the MoE's sums in the FFN half's: kernels/hc_expand.py; the router after its product one kernel:
# kernels/moe_route.py; bf16 norms one kernel each by default: kernels/rms_norm_cuda.py).
MAX_CUDA_STEP_NODES = {"plain": (414, 526), "official": (406, 514)}  # fmt: (ordinary, closing)


def _nodes(arrays, path) -> int:
    return sum(primitive_kinds(arrays, path).values())


def _nodes_per_extra_sequence(tmp_path, monkeypatch, dtype: str = "float32") -> float:
    """Graph nodes decode attention adds per extra sequence and step (batch 12 against batch 4)."""
    model = load_model(make_model(tmp_path / "m", "tiny", seed=2, with_tokenizer=False, **OVERRIDES), dtype=dtype)
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
        assert counted and min(counted) > 0  # every layer's graph was seen: the bounds below are not vacuous
        return sum(counted) / 4

    monkeypatch.setattr(attention, "decode_attention", counting)
    return (step_nodes(12) - step_nodes(4)) / 8


def test_decode_attention_adds_few_graph_nodes_per_sequence(tmp_path, monkeypatch):
    per_sequence = _nodes_per_extra_sequence(tmp_path, monkeypatch)
    assert per_sequence <= MAX_NODES_PER_SEQUENCE, per_sequence


def test_on_cuda_the_indexer_and_the_selected_rows_are_one_node_per_batch(tmp_path, monkeypatch):
    """The CUDA path (kernels stood in by one node each on their inputs, docs/bench/cuda_standin.py): the batched
    indexer kernel and the batched row gather read every sequence's buffers where they lie, so what decode
    attention still does per sequence is appending the rows its token completed (kernels/indexer_cuda,
    kernels/row_gather)."""
    monkeypatch.setattr(indexer_cuda, "compiled_kernel", standin_kernel)
    monkeypatch.setattr(indexer_cuda, "batch_is_supported", lambda q: True)
    monkeypatch.setattr(row_gather, "compiled_kernel", standin_kernel)
    monkeypatch.setattr(row_gather, "batch_is_supported", lambda xs, idx: True)
    # bf16, a GPU's dtype: the kernels take bf16 buffers, so a float32 model would add a cast per sequence
    per_sequence = _nodes_per_extra_sequence(tmp_path, monkeypatch, dtype="bfloat16")
    assert per_sequence <= MAX_NODES_PER_SEQUENCE_ON_CUDA, per_sequence


@pytest.mark.parametrize("fmt, dtype", [("plain", "float32"), ("official", "bfloat16")])
def test_the_cuda_paths_decode_step_builds_no_more_nodes_than_it_did(tmp_path, fmt, dtype):
    """One sequence's decode steps with the CUDA path's graph (kernels stood in by a node each), four of them so
    that one closes the CSA windows: neither kind of step grows past its count (MAX_CUDA_STEP_NODES)."""
    model = load_model(make_model(tmp_path / "m", "tiny", seed=2, with_tokenizer=False, fmt=fmt, **OVERRIDES), dtype=dtype)
    cache = model.new_cache()
    model.forward([Segment(cache, list(range(3, 40)))])
    counts = []
    with cuda_graph_on_cpu():
        mx.eval(model.forward([Segment(cache, [1])]), cache.arrays())  # the compiled parts traced
        for token in range(2, 6):
            logits = model.forward([Segment(cache, [token])])
            counts.append(_nodes([*logits, *cache.arrays()], tmp_path / "step.dot"))
            mx.eval(logits, cache.arrays())
    ordinary, closing = min(counts), max(counts)
    assert counts.count(ordinary) == 3 and closing > ordinary, counts  # one step of four closes the windows
    max_ordinary, max_closing = MAX_CUDA_STEP_NODES[fmt]
    assert ordinary <= max_ordinary and closing <= max_closing, counts


def test_the_hca_mask_hides_the_rows_past_a_sequences_visible_count():
    """decode_attention._all_compressed_rows: the all-true leaf where every row is visible (a decode step), and
    each row's own count where a sequence sees fewer rows than its buffer holds: no row past it is attended."""
    from tessera.engine.model.attention_inputs import SegmentSlice
    from tessera.engine.model.cache import LayerCache, RowBuffer
    from tessera.engine.model.decode_attention import _all_compressed_rows

    def segment(start: int) -> SegmentSlice:
        rows = RowBuffer(8)
        rows.append(mx.ones((5, 8)))
        return SegmentSlice(offset=0, length=1, start=start, cache=LayerCache(stored_window=mx.zeros((0, 8)), compressed=rows))

    segs = [segment(40), segment(40)]
    _, valid = _all_compressed_rows(segs, [5, 5])
    assert valid.tolist() == [[True] * 5] * 2
    _, valid = _all_compressed_rows(segs, [5, 3])
    assert valid.tolist() == [[True] * 5, [True, True, True, False, False]]
