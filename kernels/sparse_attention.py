"""Mixed attention of one tile of queries over its own gathered rows (window ∪ selected compressed
rows), optionally rows shared by every query (HCA's compressed rows), and a per-head sink.

Every product is batched per query row with a fixed per-row shape, so a row's output does not
depend on which tile it lands in, whatever BLAS runs underneath (DESIGN.md §3.3).
"""

from __future__ import annotations

import mlx.core as mx


def mixed_attention_reference(
    q: mx.array,
    rows: mx.array,
    row_valid: mx.array,
    sinks: mx.array,
    scale: float,
    shared: mx.array | None = None,
    shared_valid: mx.array | None = None,
) -> mx.array:
    """q: [T, H, d]; rows: [T, R, d] (K = V); row_valid: [T, R]; sinks: [H];
    shared: [S, d] with shared_valid: [T, S] -> out [T, H, d]."""
    num_q, num_heads, _ = q.shape
    values = [rows]
    logits = [_masked(q @ rows.transpose(0, 2, 1) * scale, row_valid)]  # [T, H, R]
    if shared is not None and shared.shape[0] > 0:
        shared_b = mx.broadcast_to(shared[None], (num_q,) + shared.shape)  # [T, S, d], no copy
        logits.append(_masked(q @ shared_b.transpose(0, 2, 1) * scale, shared_valid))
        values.append(shared_b)
    sink = mx.broadcast_to(sinks.astype(q.dtype)[None, :, None], (num_q, num_heads, 1))
    probs = mx.softmax(mx.concatenate(logits + [sink], axis=-1), axis=-1, precise=True)
    out, start = None, 0
    for v in values:
        part = probs[..., start : start + v.shape[1]] @ v  # [T, H, d]
        out = part if out is None else out + part
        start += v.shape[1]
    return out


def _masked(logits: mx.array, valid: mx.array) -> mx.array:
    return mx.where(valid[:, None, :], logits, -mx.inf)


def mixed_attention(
    q: mx.array,
    rows: mx.array,
    row_valid: mx.array,
    sinks: mx.array,
    scale: float,
    shared: mx.array | None = None,
    shared_valid: mx.array | None = None,
) -> mx.array:
    """Dispatch: a fused kernel where one exists for the device, else the reference."""
    return mixed_attention_reference(q, rows, row_valid, sinks, scale, shared, shared_valid)
