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
import numpy as np

from tessera.engine.model.cache import CompressorFrontier, FrontierSlots, Stacked, stacked
from tessera.engine.model.config import RopeSpec
from tessera.engine.model.norms import rms_norm
from tessera.engine.model.quantized import Weight, linear
from tessera.engine.model.rope import apply_rope, rope_tables
from tessera.kernels.shapeless import shapeless


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
) -> tuple[mx.array, CompressorFrontier]:
    """x: [L, hidden] (tokens following the frontier) -> (newly completed rows [n, head_dim], the
    frontier after them). `frontier` is a value: read, never written."""
    kv = linear(x, weights.wkv)  # [L, width]
    gate = linear(x, weights.wgate)  # [L, width]
    if frontier.pending_kv is not None:
        kv = mx.concatenate([frontier.pending_kv, kv])
        gate = mx.concatenate([frontier.pending_gate, gate])
    num_windows = kv.shape[0] // ratio
    usable = num_windows * ratio
    head_dim = weights.norm.shape[0]
    if num_windows == 0:
        after = CompressorFrontier.holding(kv, gate, frontier.overlap_kv, frontier.overlap_gate, frontier.num_emitted, ratio)
        return mx.zeros((0, head_dim), dtype=x.dtype), after
    pending_kv, pending_gate = kv[usable:], gate[usable:]
    kv = kv[:usable].reshape(num_windows, ratio, -1)  # [n, ratio, width]
    gate = gate[:usable].reshape(num_windows, ratio, -1) + weights.ape
    overlap = (None, None)
    if overlapping:
        kv, gate, overlap = _overlap_slots(kv, gate, frontier, head_dim)
    positions = mx.arange(num_windows) * ratio + frontier.num_emitted * ratio
    after = CompressorFrontier.holding(pending_kv, pending_gate, *overlap, frontier.num_emitted + num_windows, ratio)
    return _pooled_rows(kv, gate, weights, positions, rope, eps), after


def _pooled_rows(kv: mx.array, gate: mx.array, weights: CompressorWeights, positions: mx.array, rope: RopeSpec,
                 eps: float) -> mx.array:
    """Closed windows kv, gate [n, slots, ·] (gate biased) -> their compressed rows [n, head_dim]: the
    gate-softmax-weighted sum of the slots, normed, rotated at `positions` [n]. One owner for prefill
    (`compress`) and decode (`compress_decode`), so the two give the same bits."""
    rows = rms_norm(_pool(kv, gate), weights.norm, eps)  # [n, head_dim]
    return apply_rope(rows, rope_tables(rope, positions, rows.shape[-1]))


@shapeless
def _pool(kv: mx.array, gate: mx.array) -> mx.array:
    """kv, gate [n, slots, d] -> [n, d]: each window's slots summed, weighted by the softmax of their gates
    (float32) over the slots. Compiled (kernels/shapeless.py): the softmax's elementwise steps fuse with
    the weighting; a decode batch whose sequences close windows at different steps pools every step."""
    return (kv * mx.softmax(gate.astype(mx.float32), axis=1, precise=True).astype(kv.dtype)).sum(axis=1)


def _overlap_slots(
    kv: mx.array, gate: mx.array, frontier: CompressorFrontier, head_dim: int
) -> tuple[mx.array, mx.array, tuple[mx.array, mx.array]]:
    """[n, ratio, 2d] windows -> [n, 2·ratio, d] slots: previous window's Ca, then this window's Cb;
    and the last window's Ca half (kv, gate), the next call's overlap.

    Window 0's Ca slots come from the frontier; before any window closed they are zero kv with a
    -inf gate (softmax weight 0), as in the reference.
    """
    ratio = kv.shape[1]
    ca_kv, cb_kv = kv[..., :head_dim], kv[..., head_dim:]
    ca_gate, cb_gate = gate[..., :head_dim], gate[..., head_dim:]
    if frontier.overlap_kv is None:
        first_kv, first_gate = _no_overlap(1, ratio, head_dim, kv.dtype, gate.dtype)
    else:
        first_kv, first_gate = frontier.overlap_kv[None], frontier.overlap_gate[None]
    prev_kv = mx.concatenate([first_kv, ca_kv[:-1]])
    prev_gate = mx.concatenate([first_gate, ca_gate[:-1]])
    slots = mx.concatenate([prev_kv, cb_kv], axis=1), mx.concatenate([prev_gate, cb_gate], axis=1)
    return *slots, (ca_kv[-1], ca_gate[-1])


def _no_overlap(n: int, ratio: int, head_dim: int, kv_dtype: mx.Dtype, gate_dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """The Ca slots before any window closed: zero kv, -inf gate -> [n, ratio, d] each."""
    return mx.zeros((n, ratio, head_dim), dtype=kv_dtype), mx.full((n, ratio, head_dim), -mx.inf, dtype=gate_dtype)


def compress_decode(
    x: mx.array,
    weights: CompressorWeights,
    frontiers: list[CompressorFrontier],
    ratio: int,
    overlapping: bool,
    rope: RopeSpec,
    eps: float,
    projected: tuple[mx.array, mx.array] | None = None,
) -> tuple[list[mx.array | None], list[CompressorFrontier]]:
    """x: [B, hidden], the next token of each of B sequences (frontiers[i] is sequence i's) -> (per
    sequence the row its token completed ([1, head_dim]) or None, the frontiers after the step).
    `projected`: x's kv and gate projections [B, width] if the caller computed them (stacked with the
    layer's other input projections, attention_inputs.StackedInputs), else they are computed here.

    The same rows and frontiers as `compress` on each token alone, in a number of graph ops that does
    not grow with B: the open groups of all B sequences live in one [B, ratio, width] array
    (`FrontierSlots`), each token is written into its sequence's next slot by one scatter, and when any
    window closes, all B windows are pooled, normed and rotated as one [B, ratio, ·] batch, the closing
    ones' rows kept (every op is per window, as in `compress`'s [n, ratio, ·] batch of windows;
    `_closed_windows`). The new frontiers are rows of the
    step's arrays, which the next step of the same sequences takes back whole (cache.stacked)."""
    num = len(frontiers)
    kv_new, gate_new = projected if projected is not None else (linear(x, weights.wkv), linear(x, weights.wgate))  # [B, width]
    slots = _stacked_slots(frontiers, ratio, kv_new.shape[1], weights.norm.shape[0], overlapping, kv_new.dtype)
    open_now = np.array([f.num_open for f in frontiers])
    at = mx.array(open_now.reshape(num, 1, 1))  # [B, 1, 1]: each token's slot
    kv = mx.put_along_axis(slots.kv, at, kv_new[:, None, :], axis=1)  # [B, ratio, width]
    gate = mx.put_along_axis(slots.gate, at, gate_new[:, None, :], axis=1)
    closing = [i for i in range(num) if open_now[i] + 1 == ratio]
    emitted: list[mx.array | None] = [None] * num
    overlap_kv, overlap_gate = slots.overlap_kv, slots.overlap_gate
    if closing:
        rows, overlap_kv, overlap_gate = _closed_windows(kv, gate, slots, closing, frontiers, weights, ratio, overlapping, rope, eps)
        for i in closing:
            emitted[i] = rows[i : i + 1]
    after_slots = FrontierSlots(kv, gate, overlap_kv, overlap_gate)
    shut = set(closing)
    after = [
        CompressorFrontier(f.num_emitted + (i in shut), 0 if i in shut else f.num_open + 1, after_slots, i)
        for i, f in enumerate(frontiers)
    ]
    return emitted, after


def _stacked_slots(
    frontiers: list[CompressorFrontier], ratio: int, width: int, head_dim: int, overlapping: bool, dtype: mx.Dtype
) -> FrontierSlots:
    """The B frontiers' slots as one FrontierSlots of B rows (those of one earlier step: taken whole).
    A frontier with no slots yet gets zero open slots and the "no window closed yet" overlap."""
    first = frontiers[0].slots
    if (first is not None and first.kv.shape[0] == len(frontiers) and (first.overlap_kv is not None or not overlapping)
            and all(f.slots is first and f.row == i for i, f in enumerate(frontiers))):
        return first  # the same sequences in the same order as the step before: what `stacked` makes of them

    def parts(field: str, fill) -> list:
        out = []
        for f in frontiers:
            arr = None if f.slots is None else getattr(f.slots, field)
            out.append(fill() if arr is None else Stacked(arr, f.row))
        return out

    zeros = lambda: mx.zeros((ratio, width), dtype=dtype)  # noqa: E731
    kv, gate = stacked(parts("kv", zeros)), stacked(parts("gate", zeros))
    if not overlapping:
        return FrontierSlots(kv, gate)
    no_kv, no_gate = (a[0] for a in _no_overlap(1, ratio, head_dim, dtype, dtype))
    return FrontierSlots(kv, gate, stacked(parts("overlap_kv", lambda: no_kv)), stacked(parts("overlap_gate", lambda: no_gate)))


def _closed_windows(
    kv: mx.array, gate: mx.array, slots: FrontierSlots, closing: list[int], frontiers: list[CompressorFrontier],
    weights: CompressorWeights, ratio: int, overlapping: bool, rope: RopeSpec, eps: float,
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """The step's windows kv, gate [B, ratio, width] of which rows `closing` are full after this token ->
    (every row's pooled row [B, head_dim], of which only the closing rows' mean anything; the overlap
    halves after the step [B, ratio, d] or None).

    Every row's window is pooled, the open ones too (their rows are dropped): gathering the closing rows
    out first would cost gathers and index arrays every step a batch's sequences close at different
    steps, and each row's ops are its own (per window), so a closing row's bits are the same either way."""
    num, head_dim = kv.shape[0], weights.norm.shape[0]
    gate = gate + weights.ape
    overlap_kv, overlap_gate = slots.overlap_kv, slots.overlap_gate
    if overlapping:
        ca_kv, ca_gate = kv[..., :head_dim], gate[..., :head_dim]
        kv = mx.concatenate([overlap_kv, kv[..., head_dim:]], axis=1)  # [B, 2·ratio, d]
        gate = mx.concatenate([overlap_gate, gate[..., head_dim:]], axis=1)
        if len(closing) == num:
            overlap_kv, overlap_gate = ca_kv, ca_gate
        else:  # a closing row's Ca half is the next window's overlap; the others keep theirs
            is_closing = np.zeros((num, 1, 1), dtype=bool)
            is_closing[closing] = True
            shut = mx.array(is_closing)
            overlap_kv, overlap_gate = mx.where(shut, ca_kv, overlap_kv), mx.where(shut, ca_gate, overlap_gate)
    positions = mx.array([f.num_emitted * ratio for f in frontiers])  # [B]: each window's first token
    return _pooled_rows(kv, gate, weights, positions, rope, eps), overlap_kv, overlap_gate
