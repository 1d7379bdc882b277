"""The step's decode rows — segments of one token — attended together: the compressors' per-token
updates, the lightning indexer, the top-k and the mixed attention run as one batched call per layer
for every decoding sequence instead of one small graph per sequence (docs/BENCHMARKS.md, "Issue 14:
batched decode across sequences").

A decode row keeps exactly the per-row shapes a one-row tile of the tiled path gives it: W window
rows, min(top_k, N) selected compressed rows (CSA) or all N compressed rows (HCA), N index keys,
where N is the layer's compressed-row count of that sequence. Rows whose attended rows have one
shape — the same N (HCA), the same min(top_k, N) (CSA) — run as one batch of per-row products
(batched gemms compute each batch element on its own); other rows run as separate batches. What a
row attends is never padded, so its result cannot depend on the other sequences of the step; the
indexer's scores of a CSA batch are padded with -inf past each sequence's N, which the top-k never
picks while N ≥ top_k. So batched == single bit for bit, and a decode row equals the same row of a
fresh whole-sequence prefill (tests/equivalence/test_batched_decode.py,
tests/equivalence/test_tiled_chunked_decode.py).

The per-layer work is a fixed number of graph ops whatever B (docs/BENCHMARKS.md "Issue 14, session
6"): the state a step leaves in each sequence's cache — its window and compressor frontiers — is a row
of one step-wide array (cache.Stacked, cache.FrontierSlots), which the next step of the same sequences
takes back whole. On a CUDA device the indexer and the selected-row gather are one kernel launch per
batch each, reading every sequence's buffers where they lie (kernels/indexer_cuda, kernels/row_gather);
elsewhere they concatenate the buffers' memoized views. What stays per sequence: appending a
compressed row when its token closes a window.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from tessera.engine.model.attention_inputs import AttentionWeights, SegmentSlice
from tessera.engine.model.cache import LayerCache, RowBuffer, Stacked, owned, stacked
from tessera.engine.model.compressor import compress_decode
from tessera.engine.model.config import CSA, HCA, WINDOW, ModelConfig
from tessera.engine.model.trace import ForwardTrace
from tessera.kernels import row_gather
from tessera.kernels.indexer import indexer_scores_batched, select_topk
from tessera.kernels.sparse_attention import decode_mixed_attention


@dataclass(frozen=True)
class DecodeRows:
    """The decode rows' inputs, in the order of `segments` (B rows)."""

    segments: list[SegmentSlice]  # one token each
    x: mx.array  # [B, D] normed block input
    kv: mx.array  # [B, hd] K = V
    q: mx.array  # [B, H, hd]
    index_q: mx.array | None  # [B, IH, ID] (CSA)
    index_w: mx.array | None  # [B, IH] (CSA)
    compressor_in: tuple[mx.array, mx.array] | None = None  # the compressor's kv, gate [B, width], if projected
    index_compressor_in: tuple[mx.array, mx.array] | None = None  # the indexer compressor's (CSA), likewise


def decode_attention(rows: DecodeRows, w: AttentionWeights, cfg: ModelConfig, layer: int, timer: ForwardTrace) -> mx.array:
    """-> [B, H, hd] attention outputs; appends every row's token to its sequence's layer cache."""
    kind = cfg.layer_types[layer]
    if kind in (CSA, HCA):
        _emit_compressed(rows, w, cfg, layer)
    window, window_valid = _window_rows(rows, cfg)  # [B, W, hd], [B, W]
    if timer.stage_sync:  # the cache arrays are listed only when a stage split evaluates them
        timer.stage("other", window, *[a for s in rows.segments for a in s.cache.arrays()])
    scale = cfg.head_dim**-0.5
    if kind == WINDOW:
        return decode_mixed_attention(rows.q, [(window, window_valid)], w.sinks, scale)
    outs, order = [], []
    for members in same_shape_batches(rows.segments, cfg.index_topk if kind == CSA else None):
        pick = _picker(members, len(rows.segments))
        segs = [rows.segments[i] for i in members]
        visible = [(s.start + 1) // cfg.compress_ratio(layer) for s in segs]  # rows from tokens ≤ each query
        if kind == CSA:
            group = _selected_rows(segs, pick(rows.index_q), pick(rows.index_w), mx.array(visible), cfg, layer, timer)
        else:
            group = _all_compressed_rows(segs, visible)
        outs.append(decode_mixed_attention(pick(rows.q), [(pick(window), pick(window_valid)), group], w.sinks, scale))
        order += members
    return _in_order(outs, order)


def same_shape_batches(segments: list[SegmentSlice], top_k: int | None = None) -> list[list[int]]:
    """Indices of `segments` grouped by the shape of the rows they attend, each group in the segments'
    order: the layer's compressed-row count N (HCA: every row), or min(top_k, N) when `top_k` is given
    (CSA: the selected rows). Sequences with different N but at least top_k rows each share one batch:
    the indexer scores each against its own N keys (-inf past them, kernels/indexer.indexer_scores_batched),
    so each still selects the k rows it selects alone."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(segments):
        num_rows = s.cache.compressed.num_rows
        groups.setdefault(num_rows if top_k is None else min(top_k, num_rows), []).append(i)
    return list(groups.values())


def _picker(members: list[int], total: int):
    """x [B, ...] -> x [members, ...] (the identity when the batch is all of them)."""
    if members == list(range(total)):
        return lambda x: x
    index = mx.array(members)
    return lambda x: None if x is None else x[index]


def _in_order(outs: list[mx.array], order: list[int]) -> mx.array:
    """Batches' outputs, concatenated in `order` -> rows back in the segments' order."""
    if len(outs) == 1:
        return outs[0]
    return mx.concatenate(outs)[mx.array(np.argsort(np.array(order)))]


def _emit_compressed(rows: DecodeRows, w: AttentionWeights, cfg: ModelConfig, layer: int) -> None:
    """Every row's token into its compressors (one batched update per compressor, cache.FrontierSlots);
    completed rows are appended to the caches before anything is scored (the tiling invariant)."""
    ratio, overlapping, rope, eps = cfg.compress_ratio(layer), cfg.is_overlapping(layer), cfg.rope_for(layer), cfg.rms_norm_eps
    caches = [s.cache for s in rows.segments]
    emitted, after = compress_decode(rows.x, w.compressor, [c.compressor for c in caches], ratio, overlapping, rope, eps,
                                     rows.compressor_in)
    for cache, row, frontier in zip(caches, emitted, after):
        cache.compressor = frontier
        if row is not None:
            cache.compressed.append(row)
    if cfg.has_indexer(layer):
        frontiers = [c.indexer_compressor for c in caches]
        emitted, after = compress_decode(rows.x, w.index_compressor, frontiers, ratio, overlapping, rope, eps,
                                         rows.index_compressor_in)
        for cache, row, frontier in zip(caches, emitted, after):
            cache.indexer_compressor = frontier
            if row is not None:
                cache.index_keys.append(row)


def _window_rows(rows: DecodeRows, cfg: ModelConfig) -> tuple[mx.array, mx.array]:
    """Each row's W window keys (its cached window, then its own K), the cache windows moved on by
    one token -> rows [B, W, hd], valid [B, W].

    Sequences with a full window (W - 1 cached rows: all but their first W - 1 tokens) take theirs as
    one [F, W - 1, hd] array — the previous step's, whole, when the same sequences stepped together
    (cache.stacked) — append their K as one column and keep rows of the result as their new windows
    (cache.Stacked: no per-sequence slice or copy). A sequence with fewer rows gathers them as the
    tiled path does (index clamped at 0, masked), one by one."""
    window, keep = cfg.sliding_window, cfg.sliding_window - 1
    caches = [s.cache for s in rows.segments]
    is_full = [keep > 0 and c.num_window_rows == keep for c in caches]
    if all(is_full):  # the steady state: no per-sequence array, and the all-valid mask made once per shape
        return _full_window_keys(caches, stacked([c.stored_window for c in caches]), rows.kv), _all_valid(len(caches), window)
    full = [i for i, f in enumerate(is_full) if f]
    short = [i for i, f in enumerate(is_full) if not f]
    parts, valid = [], np.ones((len(caches), window), dtype=bool)
    if full:
        prev = stacked([caches[i].stored_window for i in full])  # [F, W - 1, hd]
        parts.append(_full_window_keys([caches[i] for i in full], prev, _picker(full, len(caches))(rows.kv)))
    if short:
        parts.append(mx.stack([_short_window_keys(caches[i], rows.kv[i : i + 1], valid[i], window) for i in short]))
    return _in_order(parts, full + short), mx.array(valid)


def _full_window_keys(caches: list[LayerCache], prev: mx.array, kv: mx.array) -> mx.array:
    """Sequences whose windows are full: their W - 1 cached rows prev [F, W - 1, hd] and this step's K
    kv [F, hd] -> keys [F, W, hd]; each cache's window moves on to its row of keys[:, 1:]."""
    keys = mx.concatenate([prev, kv[:, None, :]], axis=1)  # [F, W, hd]
    moved = keys[:, 1:]
    for j, cache in enumerate(caches):
        cache.window = Stacked(moved, j)
    return keys


@lru_cache(maxsize=64)
def _all_valid(num_seqs: int, width: int) -> mx.array:
    """[num_seqs, width] bool, all True (the full windows' mask, the HCA rows' in a decode step): made once per
    shape from the host, a leaf of the step's graph."""
    return mx.array(np.ones((num_seqs, width), dtype=bool))


def _short_window_keys(cache: LayerCache, kv: mx.array, valid: np.ndarray, window: int) -> mx.array:
    """One sequence with fewer than W - 1 window rows: its W keys [W, hd] (`valid` [W] filled in), the
    window moved on. Index clamped at 0 as attention.window_key_indices gives the tiled path."""
    keys = mx.concatenate([cache.window, kv])  # [Wp + 1, hd]
    num_prev = keys.shape[0] - 1
    keep = window - 1
    cache.window = owned(keys[max(keys.shape[0] - keep, 0) :] if keep > 0 else keys[:0])
    key_idx = num_prev - (window - 1) + np.arange(window)  # attention.window_key_indices for row 0
    valid[:] = key_idx >= 0
    return keys[mx.array(np.maximum(key_idx, 0))]


def _selected_rows(
    segs: list[SegmentSlice], index_q: mx.array, index_w: mx.array, visible: mx.array, cfg: ModelConfig, layer: int,
    timer: ForwardTrace,
) -> tuple[mx.array, mx.array]:
    """CSA: indexer scores and top-k for a batch of equal min(top_k, N) -> (rows [b, k', hd], valid [b, k'])."""
    num_keys = max(s.cache.index_keys.num_rows for s in segs)
    if num_keys == 0:
        selected = mx.zeros((len(segs), 0), dtype=mx.int32)
        valid = selected.astype(mx.bool_)
        rows = mx.zeros((len(segs), 0, cfg.head_dim), dtype=segs[0].cache.compressed.dtype)
    else:
        keys = [s.cache.index_keys for s in segs]  # b buffers of N rows [·, ID], read where they lie
        scores = indexer_scores_batched(index_q, index_w, keys, visible, cfg.index_head_dim**-0.5)  # [b, max N]
        scores = timer.stage("indexer_score", scores)
        selected, valid = select_topk(scores, visible, cfg.index_topk)  # [b, k'], row b's indices < its N
        timer.stage("topk", selected, valid)
        rows = _gather_selected([s.cache.compressed for s in segs], selected)
    if timer.selections is not None:
        for i, s in enumerate(segs):
            timer.record_selection(layer, s.start, selected[i : i + 1], valid[i : i + 1])
    return rows, valid


# Without the CUDA kernel: up to this many bytes of compressed rows (all sequences of a batch together),
# the selected rows are gathered in one op from the buffers stacked into one [b, N, hd] copy (two graph ops);
# beyond it, one gather per sequence from its buffer where it lies (no copy, ~3 ops per sequence). A
# gather copies values, so both give the same bits (tests/equivalence/test_batched_decode.py); the
# bound only trades a transient copy (64 MiB ≈ 30 µs on an H200) against per-sequence graph ops.
STACKED_GATHER_BYTES = 64 * 2**20


def _gather_selected(buffers: list[RowBuffer], selected: mx.array) -> mx.array:
    """Each sequence's selected compressed rows: selected [b, k'] (row i's indices < buffers[i].num_rows)
    -> [b, k', hd]. On a CUDA device one kernel reads every buffer where it lies
    (kernels/row_gather.take_rows_batched_kernel: one op per step, no stacked copy)."""
    first = buffers[0]
    data = [buf.data() for buf in buffers]
    if row_gather.batch_is_supported(data, selected):
        return row_gather.take_rows_batched_kernel(data, selected)
    if len(buffers) == 1:
        return first.data()[selected]
    if sum(buf.nbytes for buf in buffers) <= STACKED_GATHER_BYTES:
        rows = mx.concatenate([buf.view() for buf in buffers])  # [Σ N_i, hd]: sequence i's rows from Σ_{j<i} N_j
        starts = np.cumsum([0] + [buf.num_rows for buf in buffers[:-1]])
        offsets = mx.array(starts[:, None], dtype=selected.dtype)  # [b, 1]: a leaf, no graph op
        return rows[selected + offsets]  # [b, k', hd] (a row gather: take_along_axis gathers per element, ~3x slower on the CPU)
    picks = mx.split(selected, len(buffers))  # b × [1, k']
    return mx.concatenate([buf.data()[p] for buf, p in zip(buffers, picks)])


def _all_compressed_rows(segs: list[SegmentSlice], visible: list[int]) -> tuple[mx.array, mx.array]:
    """HCA: every compressed row of each sequence (equal N) -> (rows [b, N, hd], valid [b, N]). Where the
    batched row gather runs (CUDA, TESSERA_DECODE_BATCH_GATHER), one launch reads every buffer where it lies
    instead of a concatenation (one copy kernel a sequence); a gather copies, so the same bits. visible: each
    sequence's visible row count, known on the host: where every row is visible (a decode step's rule: a row is
    emitted before the query that closes it is scored) the mask is the all-true leaf made once per shape, not
    an Arange, a comparison and two views in every step's graph."""
    buffers = [s.cache.compressed for s in segs]
    num_rows = buffers[0].num_rows
    if all(count >= num_rows for count in visible):
        valid = _all_valid(len(segs), num_rows)
    else:
        valid = mx.arange(num_rows)[None, :] < mx.array(visible)[:, None]
    if len(segs) > 1 and num_rows and row_gather.batch_gather_enabled():
        data, every_row = [buf.data() for buf in buffers], _every_row(len(segs), num_rows)
        if row_gather.batch_is_supported(data, every_row):
            return row_gather.take_rows_batched_kernel(data, every_row), valid
    views = [buf.stackable_view() for buf in buffers]  # b × [1, N, hd], kept between appends
    return (views[0] if len(views) == 1 else mx.concatenate(views)), valid


@lru_cache(maxsize=64)
def _every_row(num_seqs: int, num_rows: int) -> mx.array:
    """[num_seqs, num_rows] int32: 0 … num_rows - 1 in every row (the batched gather's indices), made once
    per shape from the host: a leaf of the step's graph (no op, nothing evaluated while a step is built)."""
    return mx.array(np.broadcast_to(np.arange(num_rows, dtype=np.int32), (num_seqs, num_rows)).copy())
