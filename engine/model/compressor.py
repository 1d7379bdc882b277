"""Token-to-row compressors of CSA (ratio 4, overlapping) and HCA (ratio 128) layers.

Each closed window of `ratio` tokens emits one row: a softmax-gated sum of the window's projected
rows (per channel), RMS-normed, then rotated at the position of the window's first token.
The ratio-4 compressor pools overlapping windows: row w mixes window w-1's Ca half with window w's
Cb half (2·ratio slots), so between calls it must carry the open group *and* the last closed
window's Ca half (`CompressorFrontier`). Running a sequence in any split therefore emits the same
rows as running it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from tessera.engine.model.cache import CompressorFrontier, owned
from tessera.engine.model.config import RopeSpec
from tessera.engine.model.norms import rms_norm
from tessera.engine.model.quantized import Weight, linear
from tessera.engine.model.rope import apply_rope, cos_sin


@dataclass(frozen=True)
class CompressorWeights:
    wkv: Weight  # [width, hidden]; width = 2·head_dim when overlapping
    wgate: Weight  # [width, hidden]
    ape: mx.array  # [ratio, width]: positional bias on the gate
    norm: mx.array  # [head_dim]


def compress(
    x: mx.array,
    weights: CompressorWeights,
    frontier: CompressorFrontier,
    ratio: int,
    overlapping: bool,
    rope: RopeSpec,
    eps: float,
) -> mx.array:
    """x: [L, hidden] (tokens following the frontier) -> newly completed rows [n, head_dim].

    Updates `frontier` in place (the open group, the overlap half, the emitted count).
    """
    kv = linear(x, weights.wkv)  # [L, width]
    gate = linear(x, weights.wgate)  # [L, width]
    if frontier.pending_kv is not None:
        kv = mx.concatenate([frontier.pending_kv, kv])
        gate = mx.concatenate([frontier.pending_gate, gate])
    num_windows = kv.shape[0] // ratio
    usable = num_windows * ratio
    frontier.pending_kv, frontier.pending_gate = owned(kv[usable:]), owned(gate[usable:])
    head_dim = weights.norm.shape[0]
    if num_windows == 0:
        return mx.zeros((0, head_dim), dtype=x.dtype)

    kv = kv[:usable].reshape(num_windows, ratio, -1)  # [n, ratio, width]
    gate = gate[:usable].reshape(num_windows, ratio, -1) + weights.ape
    if overlapping:
        kv, gate = _overlap_slots(kv, gate, frontier, head_dim)
    pooled = (kv * mx.softmax(gate.astype(mx.float32), axis=1, precise=True).astype(kv.dtype)).sum(axis=1)
    rows = rms_norm(pooled, weights.norm, eps)  # [n, head_dim]

    first = frontier.num_emitted * ratio
    positions = mx.arange(num_windows) * ratio + first
    cos, sin = cos_sin(rope, positions)
    frontier.num_emitted += num_windows
    return apply_rope(rows, cos, sin)


def _overlap_slots(
    kv: mx.array, gate: mx.array, frontier: CompressorFrontier, head_dim: int
) -> tuple[mx.array, mx.array]:
    """[n, ratio, 2d] windows -> [n, 2·ratio, d] slots: previous window's Ca, then this window's Cb.

    Window 0's Ca slots come from the frontier; before any window closed they are zero kv with a
    -inf gate (softmax weight 0), as in the reference.
    """
    ratio = kv.shape[1]
    ca_kv, cb_kv = kv[..., :head_dim], kv[..., head_dim:]
    ca_gate, cb_gate = gate[..., :head_dim], gate[..., head_dim:]
    if frontier.overlap_kv is None:
        first_kv = mx.zeros((1, ratio, head_dim), dtype=kv.dtype)
        first_gate = mx.full((1, ratio, head_dim), -mx.inf, dtype=gate.dtype)
    else:
        first_kv, first_gate = frontier.overlap_kv[None], frontier.overlap_gate[None]
    prev_kv = mx.concatenate([first_kv, ca_kv[:-1]])
    prev_gate = mx.concatenate([first_gate, ca_gate[:-1]])
    frontier.overlap_kv, frontier.overlap_gate = owned(ca_kv[-1]), owned(ca_gate[-1])
    return mx.concatenate([prev_kv, cb_kv], axis=1), mx.concatenate([prev_gate, cb_gate], axis=1)


def compress_decode(
    x: mx.array,
    weights: CompressorWeights,
    frontiers: list[CompressorFrontier],
    ratio: int,
    overlapping: bool,
    rope: RopeSpec,
    eps: float,
) -> list[mx.array | None]:
    """x: [B, hidden], the next token of each of B sequences (frontiers[i] is sequence i's) -> per
    sequence the row its token completed ([1, head_dim]) or None.

    The same rows and frontier updates as `compress` on each token alone: the projections run once
    for the batch, and the windows that close are pooled, normed and rotated as one [E, ratio, ·]
    batch (every op is per window, as in `compress`'s [n, ratio, ·] batch of windows)."""
    kv_all, gate_all = linear(x, weights.wkv), linear(x, weights.wgate)  # [B, width]
    closing: list[tuple[int, mx.array, mx.array]] = []
    for i, frontier in enumerate(frontiers):
        kv, gate = kv_all[i : i + 1], gate_all[i : i + 1]
        fresh = frontier.pending_kv is not None  # a concatenation owns its buffer; a bare slice does not
        if fresh:
            kv = mx.concatenate([frontier.pending_kv, kv])
            gate = mx.concatenate([frontier.pending_gate, gate])
        if kv.shape[0] < ratio:
            frontier.pending_kv, frontier.pending_gate = (kv, gate) if fresh else (owned(kv), owned(gate))
        else:
            frontier.pending_kv, frontier.pending_gate = owned(kv[ratio:]), owned(gate[ratio:])
            closing.append((i, kv, gate))
    emitted: list[mx.array | None] = [None] * len(frontiers)
    if not closing:
        return emitted
    closed = [frontiers[i] for i, _, _ in closing]
    kv = mx.stack([c[1] for c in closing])  # [E, ratio, width]
    gate = mx.stack([c[2] for c in closing]) + weights.ape
    head_dim = weights.norm.shape[0]
    if overlapping:
        kv, gate = _overlap_slots_per_window(kv, gate, closed, head_dim)
    pooled = (kv * mx.softmax(gate.astype(mx.float32), axis=1, precise=True).astype(kv.dtype)).sum(axis=1)
    rows = rms_norm(pooled, weights.norm, eps)  # [E, head_dim]
    cos, sin = cos_sin(rope, mx.array([f.num_emitted * ratio for f in closed]))
    rows = apply_rope(rows, cos, sin)
    for e, (i, _, _) in enumerate(closing):
        frontiers[i].num_emitted += 1
        emitted[i] = rows[e : e + 1]
    return emitted


def _overlap_slots_per_window(
    kv: mx.array, gate: mx.array, frontiers: list[CompressorFrontier], head_dim: int
) -> tuple[mx.array, mx.array]:
    """`_overlap_slots` for E windows of E different sequences (one window each, frontiers[e] is
    window e's): [E, ratio, 2d] -> [E, 2·ratio, d]."""
    ratio = kv.shape[1]
    ca_kv, cb_kv = kv[..., :head_dim], kv[..., head_dim:]
    ca_gate, cb_gate = gate[..., :head_dim], gate[..., head_dim:]
    prev_kv, prev_gate = [], []
    for e, frontier in enumerate(frontiers):
        if frontier.overlap_kv is None:
            prev_kv.append(mx.zeros((ratio, head_dim), dtype=kv.dtype))
            prev_gate.append(mx.full((ratio, head_dim), -mx.inf, dtype=gate.dtype))
        else:
            prev_kv.append(frontier.overlap_kv)
            prev_gate.append(frontier.overlap_gate)
        frontier.overlap_kv, frontier.overlap_gate = owned(ca_kv[e]), owned(ca_gate[e])
    prev_kv, prev_gate = mx.stack(prev_kv), mx.stack(prev_gate)  # [E, ratio, d]
    return mx.concatenate([prev_kv, cb_kv], axis=1), mx.concatenate([prev_gate, cb_gate], axis=1)
