"""Mixed attention of one tile of queries over groups of rows — the query's window rows, its
selected compressed rows (CSA), or compressed rows shared by every query (HCA, broadcast without a
copy) — plus a per-head sink, under one softmax.

Every product is batched per query row with a fixed per-row shape, so a row's output does not
depend on which tile it lands in, whatever BLAS runs underneath (docs/ARCHITECTURE.md, "Tiling invariants"). Groups are kept
apart rather than concatenated so the gathered rows exist once.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import mlx.core as mx

from tessera.kernels import decode_attention_cuda
from tessera.kernels.decode_attention_cuda import RowGroup
from tessera.kernels.shapeless import shapeless


def mixed_attention_reference(q: mx.array, groups: Sequence[RowGroup], sinks: mx.array, scale: float) -> mx.array:
    """q: [T, H, d], groups of (rows [T, R_i, d], valid [T, R_i]), sinks: [H] -> [T, H, d].

    Written for few graph nodes per call (a decode step runs it once per layer and same-length
    batch, docs/BENCHMARKS.md "Issue 14, session 6"): each group's scaling and mask are one fused
    kernel, and one split hands each group its probabilities (not a slice per group)."""
    num_q, num_heads, _ = q.shape
    # A group without rows (an HCA or CSA layer before its first compressed row: any context shorter than
    # the compression ratio) adds nothing to the softmax or the sum, and its products would contract over
    # a zero-length axis, which MLX 0.32.4's CUDA matmul does not survive (a segfault on the H200).
    groups = [(rows, valid) for rows, valid in groups if rows.shape[1] > 0]
    # Products in the rows' dtype (bf16 on a GPU), softmax in float32.
    logits = [_masked_logits(q @ rows.transpose(0, 2, 1), valid[:, None, :], scale) for rows, valid in groups]
    sink = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None], (num_q, num_heads, 1))
    probs = mx.softmax(mx.concatenate(logits + [sink], axis=-1), axis=-1, precise=True)  # [T, H, ΣR + 1]
    ends = list(itertools.accumulate(rows.shape[1] for rows, _ in groups))
    out = mx.zeros_like(q) if not groups else None  # every probability on the sink
    for (rows, _), group_probs in zip(groups, mx.split(probs, ends, axis=-1)):  # the last part is the sink's
        part = group_probs.astype(rows.dtype) @ rows  # [T, H, d]
        out = part if out is None else out + part
    return out


@shapeless
def _masked_logits(products: mx.array, valid: mx.array, scale: float) -> mx.array:
    """products [T, H, R] (rows' dtype), valid [T, 1, R] -> scaled float32 logits, -inf where invalid."""
    return mx.where(valid, products.astype(mx.float32) * scale, -mx.inf)


def shared_rows(rows: mx.array, num_queries: int) -> mx.array:
    """[S, d] rows every query sees -> a [T, S, d] view (stride 0, no copy)."""
    return mx.broadcast_to(rows[None], (num_queries,) + rows.shape)


def mixed_attention(q: mx.array, groups: Sequence[RowGroup], sinks: mx.array, scale: float) -> mx.array:
    """A prefill tile's mixed attention: the reference on every device. The decode kernel stays out of tiles,
    whatever their size, so that a prompt row's output never depends on which tile it lands in."""
    return mixed_attention_reference(q, groups, sinks, scale)


def decode_mixed_attention(q: mx.array, groups: Sequence[RowGroup], sinks: mx.array, scale: float) -> mx.array:
    """A decode batch's mixed attention (one token a row): one CUDA kernel where it runs
    (kernels/decode_attention_cuda.py), else the reference. Whether the kernel runs depends on a row's own
    attended-row count, never on the batch around it."""
    if decode_attention_cuda.is_supported(q, groups):
        return decode_attention_cuda.decode_attention_kernel(q, groups, sinks, scale)
    return mixed_attention_reference(q, groups, sinks, scale)
