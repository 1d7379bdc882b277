"""V4 attention for one layer over a batch of segments (one segment = some tokens of one sequence).

Projections run on every token of the step at once; the compressor, the indexer and the mixed
attention run per segment, the last two in tiles of `tile` query rows (DESIGN.md §3):
compress first, then per tile score → top-k → gather window ∪ selected rows → attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.cache import LayerCache
from engine.compressor import CompressorWeights, compress
from engine.config import CSA, HCA, WINDOW, ModelConfig
from engine.norms import rms_norm, unweighted_rms_norm
from engine.rope import apply_rope, cos_sin
from engine.trace import ForwardTrace
from kernels.indexer import indexer_scores, select_topk
from kernels.sparse_attention import mixed_attention, shared_rows


@dataclass(frozen=True)
class AttentionWeights:
    wq_a: mx.array  # [q_lora, D]
    q_norm: mx.array  # [q_lora]
    wq_b: mx.array  # [H·hd, q_lora]
    wkv: mx.array  # [hd, D]
    kv_norm: mx.array  # [hd]
    wo_a: mx.array  # [G·o_lora, H·hd / G]
    wo_b: mx.array  # [D, G·o_lora]
    sinks: mx.array  # [H]
    compressor: CompressorWeights | None = None
    index_compressor: CompressorWeights | None = None
    index_wq_b: mx.array | None = None  # [IH·ID, q_lora]
    index_weights_proj: mx.array | None = None  # [IH, D]


@dataclass(frozen=True)
class SegmentSlice:
    """Tokens [offset, offset + length) of the step's flat batch belong to one sequence whose cache
    already holds `start` tokens."""

    offset: int
    length: int
    start: int
    cache: LayerCache


@dataclass(frozen=True)
class _Queries:
    q: mx.array  # [T, H, hd]
    kv: mx.array  # [T, hd] (K = V)
    index_q: mx.array | None  # [T, IH, ID]
    index_w: mx.array | None  # [T, IH]


def attention(
    x: mx.array,
    positions: mx.array,
    segments: list[SegmentSlice],
    w: AttentionWeights,
    cfg: ModelConfig,
    layer: int,
    tile: int,
    timer: ForwardTrace,
) -> mx.array:
    """x: [T, D] (normed block input), positions: [T] -> [T, D]."""
    rope = cfg.rope_for(layer)
    cos, sin = cos_sin(rope, positions)
    queries = _project(x, cos, sin, w, cfg, layer)
    outs = [_segment_attention(x, queries, seg, w, cfg, layer, tile, timer) for seg in segments]
    out = mx.concatenate(outs) if len(outs) > 1 else outs[0]  # [T, H, hd]
    # K = V carried RoPE into the output's rope slice: rotate back by the query position.
    out = apply_rope(out, cos, -sin)
    return _grouped_output(out, w, cfg)


def _project(x: mx.array, cos: mx.array, sin: mx.array, w: AttentionWeights, cfg: ModelConfig, layer: int) -> _Queries:
    num_tokens, eps = x.shape[0], cfg.rms_norm_eps
    q_residual = rms_norm(x @ w.wq_a.T, w.q_norm, eps)  # [T, q_lora]
    q = (q_residual @ w.wq_b.T).reshape(num_tokens, cfg.num_attention_heads, cfg.head_dim)
    q = apply_rope(unweighted_rms_norm(q, eps), cos, sin)
    kv = apply_rope(rms_norm(x @ w.wkv.T, w.kv_norm, eps), cos, sin)  # [T, hd]
    if not cfg.has_indexer(layer):
        return _Queries(q, kv, None, None)
    index_q = (q_residual @ w.index_wq_b.T).reshape(num_tokens, cfg.index_n_heads, cfg.index_head_dim)
    index_q = apply_rope(index_q, cos, sin)  # CSA layers use the compress table for q and keys alike
    index_w = (x @ w.index_weights_proj.T) * (cfg.index_n_heads**-0.5)  # [T, IH]
    return _Queries(q, kv, index_q, index_w)


def _grouped_output(out: mx.array, w: AttentionWeights, cfg: ModelConfig) -> mx.array:
    """[T, H, hd] -> [T, D]: per-group low-rank projection, then one mixing projection."""
    num_tokens, groups = out.shape[0], cfg.o_groups
    grouped = out.reshape(num_tokens, groups, -1).transpose(1, 0, 2)  # [G, T, H·hd / G]
    wo_a = w.wo_a.reshape(groups, cfg.o_lora_rank, -1)  # [G, o_lora, H·hd / G]
    mid = (grouped @ wo_a.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(num_tokens, -1)  # [T, G·o_lora]
    return mid @ w.wo_b.T


def _segment_attention(
    x: mx.array,
    queries: _Queries,
    seg: SegmentSlice,
    w: AttentionWeights,
    cfg: ModelConfig,
    layer: int,
    tile: int,
    timer: ForwardTrace,
) -> mx.array:
    """Attention of one segment's queries -> [L, H, hd]; appends to its layer cache."""
    lo, hi = seg.offset, seg.offset + seg.length
    cache, kind = seg.cache, cfg.layer_types[layer]
    # Invariant 1: every row completed inside the segment exists before any tile is scored.
    if kind in (CSA, HCA):
        _emit_compressed(x[lo:hi], seg, w, cfg, layer)
    keys = mx.concatenate([cache.window, queries.kv[lo:hi]])  # [Wp + L, hd]
    num_prev = cache.window.shape[0]
    timer.stage("other", keys, *_compressed_views(cache))
    outs = []
    for r0 in range(0, seg.length, tile):
        r1 = min(r0 + tile, seg.length)
        outs.append(_tile_attention(queries, keys, num_prev, seg, r0, r1, w, cfg, layer, timer))
    keep = cfg.sliding_window - 1
    cache.window = keys[max(keys.shape[0] - keep, 0) :] if keep > 0 else keys[:0]
    return mx.concatenate(outs) if len(outs) > 1 else outs[0]


def _compressed_views(cache: LayerCache) -> list[mx.array]:
    return [buf.view() for buf in (cache.compressed, cache.index_keys) if buf is not None]


def _emit_compressed(x: mx.array, seg: SegmentSlice, w: AttentionWeights, cfg: ModelConfig, layer: int) -> None:
    cache, ratio, eps = seg.cache, cfg.compress_ratio(layer), cfg.rms_norm_eps
    overlapping, rope = cfg.is_overlapping(layer), cfg.rope_for(layer)
    cache.compressed.append(compress(x, w.compressor, cache.compressor, ratio, overlapping, rope, eps))
    if cfg.has_indexer(layer):
        keys = compress(x, w.index_compressor, cache.indexer_compressor, ratio, overlapping, rope, eps)
        cache.index_keys.append(keys)


def _tile_attention(
    queries: _Queries,
    keys: mx.array,
    num_prev: int,
    seg: SegmentSlice,
    r0: int,
    r1: int,
    w: AttentionWeights,
    cfg: ModelConfig,
    layer: int,
    timer: ForwardTrace,
) -> mx.array:
    """Query rows [r0, r1) of the segment -> [t, H, hd]."""
    window = cfg.sliding_window
    local = mx.arange(r0, r1)  # [t]
    # Query at local row r sees keys[num_prev + r - window + 1 .. num_prev + r]; earlier ones don't exist.
    key_idx = num_prev + local[:, None] - (window - 1) + mx.arange(window)[None, :]  # [t, W]
    groups = [(keys[mx.maximum(key_idx, 0)], key_idx >= 0)]  # window rows [t, W, hd]
    lo = seg.offset
    q = queries.q[lo + r0 : lo + r1]
    kind = cfg.layer_types[layer]
    if kind != WINDOW:
        visible = (seg.start + local + 1) // cfg.compress_ratio(layer)  # [t]: rows from tokens ≤ the query
        compressed = seg.cache.compressed.view()  # [N, hd]
        if kind == CSA:
            selected, selected_valid = _select(queries, lo + r0, lo + r1, seg, visible, cfg, layer, timer)
            groups.append((compressed[selected], selected_valid))  # [t, k, hd]
        else:
            groups.append((shared_rows(compressed, r1 - r0), mx.arange(compressed.shape[0])[None, :] < visible[:, None]))
    out = mixed_attention(q, groups, w.sinks, cfg.head_dim**-0.5)
    return timer.stage("attention", out)


def _select(
    queries: _Queries, q0: int, q1: int, seg: SegmentSlice, visible: mx.array, cfg: ModelConfig, layer: int,
    timer: ForwardTrace,
) -> tuple[mx.array, mx.array]:
    """Indexer for one tile: [t, N] scores in one scratch, then top-k -> (rows, valid) [t, k]."""
    index_keys = seg.cache.index_keys.view()  # [N, ID]
    if index_keys.shape[0] == 0:
        empty = mx.zeros((q1 - q0, 0), dtype=mx.int32)
        timer.record_selection(layer, seg.start + q0 - seg.offset, empty, empty.astype(mx.bool_))
        return empty, empty.astype(mx.bool_)
    scale = cfg.index_head_dim**-0.5
    scores = indexer_scores(queries.index_q[q0:q1], queries.index_w[q0:q1], index_keys, visible, scale)
    scores = timer.stage("indexer_score", scores)
    selected, valid = select_topk(scores, visible, cfg.index_topk)
    timer.stage("topk", selected, valid)
    timer.record_selection(layer, seg.start + q0 - seg.offset, selected, valid)
    return selected, valid
