"""Lightning-indexer scoring and top-k selection for one tile of query rows (docs/ARCHITECTURE.md, "Tiling invariants").

score[r, s] = Σ_h w[r, h] · ReLU(q[r, h] · k[s]) · scale, rows s ≥ visible[r] masked to -inf; the
top-k keeps the best `k` visible rows (all of them when fewer), ties going to the lower index, and
returns them in ascending order so attention sums run in one fixed order.

The scratch is one [T, N] float32 accumulator: heads are added into it one at a time in a fixed
order, never materializing [T, heads, N] (arrays past 2³¹ elements also fail in MLX's CUDA kernels: docs/BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import mlx.core as mx

from tessera.kernels import indexer_cuda, topk_cuda


# Below this many [T, N] score elements (4 MiB of float32) the per-head evaluation is skipped: a
# few such buffers alive at once cost little, while a host round trip per head dominated decode
# steps (docs/BENCHMARKS.md "Issue 14").
LAZY_SCRATCH_ELEMENTS = 2**20


def indexer_scores_reference(
    q: mx.array, head_weights: mx.array, keys: mx.array, visible: mx.array, scale: float
) -> mx.array:
    """q: [T, heads, d], head_weights: [T, heads], keys: [N, d], visible: [T] -> scores [T, N] fp32."""
    num_q, num_heads, _ = q.shape
    if num_q * num_heads * keys.shape[0] <= LAZY_SCRATCH_ELEMENTS:
        return mask_invisible(_scores_all_heads(q, head_weights, keys, scale), visible)
    keys_t = keys.astype(mx.float32).T  # [d, N]
    scores = mx.zeros((num_q, keys.shape[0]), dtype=mx.float32)
    per_head_eval = scores.size >= LAZY_SCRATCH_ELEMENTS
    for h in range(num_heads):
        per_head = mx.maximum(q[:, h, :].astype(mx.float32) @ keys_t, 0.0) * scale  # [T, N]
        scores = scores + per_head * head_weights[:, h : h + 1].astype(mx.float32)
        # Evaluate head by head: left lazy, MLX may run several heads' [T, N] products before
        # summing them (measured: up to ~10 such buffers live at 64k context on CPU).
        if per_head_eval:
            mx.eval(scores)
    return mask_invisible(scores, visible)


def _scores_all_heads(q: mx.array, head_weights: mx.array, keys: mx.array, scale: float) -> mx.array:
    """The same sum as the head loop in a handful of ops, for a small [T, heads, N] (decode: a loop
    of ~13 tiny ops per head was most of a step's per-sequence graph). Each head's row of the one
    gemm equals its own gemm (a row-invariant BLAS, as every exactness contract here assumes), and
    the heads are accumulated in the loop's order: a cumulative sum along the head axis is that
    sequential sum (its last entry) — `test_kernels` checks the two bit for bit."""
    num_q, num_heads, dim = q.shape
    products = q.astype(mx.float32).reshape(num_q * num_heads, dim) @ keys.astype(mx.float32).T  # [T·heads, N]
    per_head = mx.maximum(products.reshape(num_q, num_heads, -1), 0.0) * scale  # [T, heads, N]
    weighted = per_head * head_weights.astype(mx.float32)[:, :, None]
    return mx.cumsum(weighted, axis=1)[:, -1, :]  # [T, N]


# A decode batch's scores run as one [B, heads, N] product up to this many elements (16 MiB of
# float32); beyond it, one sequence at a time (each within the reference's own scratch bound).
BATCHED_SCRATCH_ELEMENTS = 2**22


def indexer_scores_batched_reference(
    q: mx.array, head_weights: mx.array, keys: mx.array, visible: mx.array, scale: float
) -> mx.array:
    """One query row per sequence, each scored against its own keys (a decode batch):
    q: [B, heads, d], head_weights: [B, heads], keys: [B, N, d], visible: [B] -> scores [B, N] fp32.

    Sequence b's row is `indexer_scores_reference(q[b:b+1], head_weights[b:b+1], keys[b], ...)` bit
    for bit: batch element b of the batched product is that sequence's [heads, N] gemm, and the
    heads are summed in the loop's order (the cumulative sum of `_scores_all_heads`)."""
    products = q.astype(mx.float32) @ keys.astype(mx.float32).transpose(0, 2, 1)  # [B, heads, N]
    per_head = mx.maximum(products, 0.0) * scale
    weighted = per_head * head_weights.astype(mx.float32)[:, :, None]
    return mask_invisible(mx.cumsum(weighted, axis=1)[:, -1, :], visible)


def mask_invisible(scores: mx.array, visible: mx.array) -> mx.array:
    """Rows s ≥ visible[r] (not yet compressed from tokens the query may see) get -inf."""
    row = mx.arange(scores.shape[1])[None, :]
    return mx.where(row < visible[:, None], scores, -mx.inf)


def select_topk_reference(scores: mx.array, visible: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """scores: [T, N] -> (rows [T, min(k, N)] int32 ascending, valid [T, min(k, N)] bool).

    A stable sort makes ties go to the lower row index; picks beyond the visible rows come back
    marked invalid (they only appear when fewer than k rows are visible).
    """
    k = min(k, scores.shape[1])
    best = mx.argsort(-scores, axis=-1)[:, :k]
    rows = mx.sort(best.astype(mx.int32), axis=-1)
    return rows, rows < visible[:, None]


def select_topk_threshold(scores: mx.array, visible: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Same selection as `select_topk_reference` without a full sort (the GPU path): find the k-th
    largest value v with `topk`, keep every row scoring above v, then the lowest-index rows scoring
    exactly v until k are kept — the lower-index tie-break made explicit instead of relying on a
    stable sort. Two `topk` passes and a cumsum over [T, N]."""
    num_rows = scores.shape[1]
    k = min(k, num_rows)
    kth = mx.min(mx.topk(scores, k, axis=-1), axis=-1, keepdims=True)  # [T, 1]
    above = scores > kth
    at = scores == kth
    room = k - above.sum(axis=-1, keepdims=True)  # how many of the tied rows fit
    keep = above | (at & (mx.cumsum(at.astype(mx.int32), axis=-1) <= room))
    order = mx.where(keep, -mx.arange(num_rows, dtype=mx.int32), -num_rows)  # larger = lower index
    rows = mx.sort(-mx.topk(order, k, axis=-1), axis=-1).astype(mx.int32)
    return rows, rows < visible[:, None]


def indexer_scores(q: mx.array, head_weights: mx.array, keys: mx.array, visible: mx.array, scale: float) -> mx.array:
    """Dispatch: the fused CUDA kernel on a CUDA device, else the reference."""
    if indexer_cuda.is_supported(q):
        return indexer_cuda.indexer_scores_kernel(q, head_weights, keys, visible, scale)
    return indexer_scores_reference(q, head_weights, keys, visible, scale)


class KeyRows(Protocol):
    """One sequence's index keys where they lie (engine/model/cache.RowBuffer): its first `num_rows`
    rows, as a view (memoized between appends) or as the whole buffer (the kernel reads it in place)."""

    num_rows: int

    def view(self) -> mx.array: ...  # [num_rows, d]

    def stackable_view(self) -> mx.array: ...  # [1, num_rows, d]

    def data(self) -> mx.array | None: ...  # [≥ num_rows, d] (None when empty)


def indexer_scores_batched(
    q: mx.array, head_weights: mx.array, keys: Sequence[KeyRows], visible: mx.array, scale: float
) -> mx.array:
    """A decode batch (q: [B, heads, d], head_weights: [B, heads], keys: B sequences' index keys,
    visible: [B]) -> scores [B, max N] fp32; sequence b's first N_b columns are its scores alone (the
    bits `indexer_scores` gives it), the rest -inf.

    On a CUDA device, one batched kernel launch (per MAX_BATCH sequences) reads every sequence's keys
    where they lie (TESSERA_DECODE_BATCH_KERNELS=0: the single kernel once per sequence). Elsewhere,
    equal N: one batched product of the memoized [1, N, d] views while the stacked scratch fits, else
    one sequence at a time; different N: one sequence at a time, padded."""
    num_seqs, num_heads, _ = q.shape
    num_keys = [k.num_rows for k in keys]
    width = max(num_keys)
    if indexer_cuda.batch_is_supported(q) and min(num_keys) > 0:
        return indexer_cuda.indexer_scores_batched_kernel(q, head_weights, [k.data() for k in keys], num_keys,
                                                          visible, scale)
    same_n = min(num_keys) == width
    stacked_fits = num_seqs * num_heads * width <= BATCHED_SCRATCH_ELEMENTS
    if same_n and stacked_fits and not indexer_cuda.is_supported(q):  # (CUDA: the single kernel per sequence)
        views = [k.stackable_view() for k in keys]  # b × [1, N, d]
        stacked = views[0] if num_seqs == 1 else mx.concatenate(views)
        return indexer_scores_batched_reference(q, head_weights, stacked, visible, scale)
    rows = []
    for b, k in enumerate(keys):
        if k.num_rows == 0:  # nothing to score (the kernel is never launched on no keys)
            rows.append(mx.full((1, width), -mx.inf, dtype=mx.float32))
            continue
        row = indexer_scores(q[b : b + 1], head_weights[b : b + 1], k.view(), visible[b : b + 1], scale)  # [1, N_b]
        rows.append(row if k.num_rows == width else mx.pad(row, [(0, 0), (0, width - k.num_rows)], constant_values=-mx.inf))
    return mx.concatenate(rows)


def select_topk(scores: mx.array, visible: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Dispatch: the radix-select kernel on a CUDA device (no full sort, no [T, N] sort scratch),
    else the stable-sort reference. `tessera check kernels` compares the two there, ties included."""
    if topk_cuda.is_supported(scores):
        return topk_cuda.select_topk_kernel(scores, visible, k)
    return select_topk_reference(scores, visible, k)
