"""V4's interleaved RoPE on the trailing `dim` channels of each head.

Two tables exist: "main" (window-only layers, plain RoPE) and "compress" (CSA/HCA layers, their
compressors and the indexer; YaRN in the released models). Frequencies follow transformers'
`_compute_yarn_parameters` exactly, so logits match the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from tessera.engine.model.config import RopeSpec
from tessera.kernels.shapeless import shapeless


@lru_cache(maxsize=16)
def _inv_freq_np(spec: RopeSpec) -> np.ndarray:
    dim, base = spec.dim, spec.theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exponents, dtype=np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if spec.yarn_factor is None:
        return inv_freq
    low, high = _yarn_correction_range(spec)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1.0) - ramp
    interpolation = (np.float32(1.0) / (np.float32(spec.yarn_factor) * pos_freqs)).astype(np.float32)
    return (interpolation * (np.float32(1.0) - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def _yarn_correction_range(spec: RopeSpec) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        original = spec.yarn_original_max_positions
        return (spec.dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low = max(math.floor(correction_dim(spec.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(spec.yarn_beta_slow)), spec.dim - 1)
    return low, (high + 0.001 if low == high else high)


def inv_freq(spec: RopeSpec) -> mx.array:
    return mx.array(_inv_freq_np(spec))


@dataclass(frozen=True)
class RopeTables:
    """A step's rotation for heads of 2·`pairs` channels whose trailing 2·`rotated` channels rotate in
    interleaved pairs, a row per position, float32: cos [L, 1, pairs, 1] and signed_sin [L, 1, pairs, 2], sin
    times (−1, 1), the signs of the swapped terms (even' = e·cos − o·sin, odd' = o·cos + e·sin). The leading
    pairs' entries are placeholders (angle 0): `apply_rope` passes those channels through as they are.

    The signs are in the table, multiplied once a step, not in every rotation: the keys' and the queries'
    rotations in one compiled trace read the same table, and a `sin · (−1, 1)` they both computed was merged
    into one node that then fused into neither, a kernel launch more a layer (docs/BENCHMARKS.md, "Session 34").

    Tables as wide as the head let the rotation write the whole head in one fused kernel: a table of the
    rotated channels alone meant slicing them off and concatenating them back, a copy kernel for each
    part (docs/BENCHMARKS.md, "Session 24")."""

    cos: mx.array
    signed_sin: mx.array
    rotated: int

    @property
    def pairs(self) -> int:
        return self.cos.shape[-2]

    def rows(self, r0: int, r1: int) -> RopeTables:
        """The tables of positions [r0, r1) (self where that is every row: no slice node)."""
        if r0 == 0 and r1 == self.cos.shape[0]:
            return self
        return RopeTables(self.cos[r0:r1], self.signed_sin[r0:r1], self.rotated)

    def inverse(self) -> RopeTables:
        """The rotation back (-sin)."""
        return RopeTables(self.cos, -self.signed_sin, self.rotated)


def cos_sin(spec: RopeSpec, positions: mx.array, width: int | None = None) -> tuple[mx.array, mx.array]:
    """positions: [L] int -> cos [L, 1, pairs, 1], signed_sin [L, 1, pairs, 2] float32 (RopeTables), one angle
    per interleaved pair, already shaped for `apply_rope`'s [L, heads, pairs, 2] pairs. pairs = width // 2
    (default: the rotated channels' spec.dim // 2); the leading pairs beyond the rotated ones get angle 0.
    A rotated pair's entries are the same bits at every width (elementwise, the same inverse frequency)."""
    pairs = (width or spec.dim) // 2
    return _cos_sin(positions.astype(mx.float32).reshape(-1, 1, 1, 1), _inv_freq_table(spec, pairs), spec.attention_factor)


def rope_tables(spec: RopeSpec, positions: mx.array, width: int) -> RopeTables:
    """The tables of heads `width` channels wide at `positions` [L] (`cos_sin`)."""
    return RopeTables(*cos_sin(spec, positions, width), rotated=spec.dim // 2)


@lru_cache(maxsize=32)
def _inv_freq_table(spec: RopeSpec, pairs: int) -> mx.array:
    """[1, 1, pairs, 1] float32: zeros, then the spec's dim // 2 inverse frequencies; built once per table
    and width (not one constant per call in every step's graph)."""
    inv = _inv_freq_np(spec)
    if pairs < inv.shape[0]:
        raise ValueError(f"a head of {2 * pairs} channels cannot hold {spec.dim} rotated ones")
    table = mx.array(np.concatenate([np.zeros(pairs - inv.shape[0], dtype=np.float32), inv])).reshape(1, 1, -1, 1)
    mx.eval(table)
    return table


_SWAPPED_SIGN = mx.array([-1.0, 1.0], dtype=mx.float32)  # even' = e·cos + o·(−sin), odd' = o·cos + e·sin


@shapeless
def _cos_sin(positions: mx.array, inv_freq: mx.array, attention_factor: float) -> tuple[mx.array, mx.array]:
    """positions: [L, 1, 1, 1] float32, inv_freq: [1, 1, pairs, 1] -> cos [L, 1, pairs, 1], signed_sin
    [L, 1, pairs, 2], fused. The sign's product is exact: the same bits as signing in the rotation."""
    freqs = positions * inv_freq
    return mx.cos(freqs) * attention_factor, (mx.sin(freqs) * attention_factor) * _SWAPPED_SIGN


class StepRope:
    """The RoPE tables of one step's positions, computed once per table, width and direction and shared by
    every layer that uses them (a model has two tables; without this each layer would build its own)."""

    def __init__(self, positions: mx.array) -> None:
        self.positions = positions  # [T] int
        self._tables: dict[tuple[RopeSpec, int, bool], RopeTables] = {}

    def tables(self, spec: RopeSpec, width: int, inverse: bool = False) -> RopeTables:
        """-> the step's tables for heads `width` channels wide (`rope_tables`); inverse: rotating back."""
        key = (spec, width, inverse)
        got = self._tables.get(key)
        if got is None:
            got = self.tables(spec, width).inverse() if inverse else rope_tables(spec, self.positions, width)
            self._tables[key] = got
        return got


def apply_rope(x: mx.array, tables: RopeTables) -> mx.array:
    """Rotate the trailing 2·rotated channels of x in interleaved pairs; the others pass through.

    x: [L, ..., 2·pairs] with the position on axis 0. `tables.inverse()` undoes the rotation.

    Written for few graph nodes (a decode step runs this ~4 times per layer, docs/BENCHMARKS.md
    "Issue 14, session 6"): each pair (even, odd) and its swapped copy (odd, even) — one reversed
    view of the pairs — meet cos and ±sin in one fused product, instead of slicing the even and odd
    channels apart and stacking them back; the pass-through channels are selected in the same kernel.
    The same products and sums as the slice-and-stack form.
    """
    pairs = tables.pairs
    if x.shape[-1] != 2 * pairs:
        raise ValueError(f"RoPE tables for {2 * pairs} channels, a head of {x.shape[-1]}")
    # [L, heads, pairs, 2] whatever x's rank (heads: the product of the middle axes, 1 for [L, 2·pairs] rows), so the
    # tables' [L, 1, pairs, ·] meet every x as they are: no reshape of them per call (two nodes a call, a host cost
    # each on a GPU: docs/BENCHMARKS.md, "Session 34").
    paired = x.reshape(x.shape[0], math.prod(x.shape[1:-1]), pairs, 2)  # `paired[..., ::-1]` is (odd, even) per pair
    cos, signed_sin = tables.cos, tables.signed_sin
    if tables.rotated == pairs:  # every channel rotates (the indexer's keys)
        return _rotated_pairs(paired, paired[..., ::-1], cos, signed_sin).reshape(x.shape)
    rotates = _rotated_mask(pairs, tables.rotated)
    return _rotated_tail(paired, paired[..., ::-1], cos, signed_sin, rotates).reshape(x.shape)


@lru_cache(maxsize=32)
def _rotated_mask(pairs: int, rotated: int) -> mx.array:
    """[pairs, 1] bool: True for the trailing `rotated` pairs. A leaf made once per shape."""
    mask = mx.array(np.arange(pairs) >= pairs - rotated).reshape(pairs, 1)
    mx.eval(mask)
    return mask


@shapeless
def _rotated_pairs(pairs: mx.array, swapped: mx.array, cos: mx.array, signed_sin: mx.array) -> mx.array:
    """pairs, swapped: [..., half, 2] (x's dtype), cos: [..., half, 1], signed_sin: [..., half, 2] ->
    [..., half, 2] rotated in float32, back in x's dtype."""
    dtype = pairs.dtype
    return (pairs.astype(mx.float32) * cos + swapped.astype(mx.float32) * signed_sin).astype(dtype)


@shapeless
def _rotated_tail(pairs: mx.array, swapped: mx.array, cos: mx.array, signed_sin: mx.array, rotates: mx.array) -> mx.array:
    """`_rotated_pairs` where `rotates` [pairs, 1], the pairs themselves elsewhere (their bits, -0 included)."""
    return mx.where(rotates, _rotated_pairs.plain(pairs, swapped, cos, signed_sin), pairs)
