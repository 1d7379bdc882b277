"""V4's interleaved RoPE on the trailing `dim` channels of each head.

Two tables exist: "main" (window-only layers, plain RoPE) and "compress" (CSA/HCA layers, their
compressors and the indexer; YaRN in the released models). Frequencies follow transformers'
`_compute_yarn_parameters` exactly, so logits match the reference.
"""

from __future__ import annotations

import math
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


def cos_sin(spec: RopeSpec, positions: mx.array) -> tuple[mx.array, mx.array]:
    """positions: [L] int -> cos, sin: [L, 1, dim // 2, 1] float32, one angle per interleaved pair,
    already shaped for `apply_rope`'s [L, heads, half, 2] pairs (no reshape per call there)."""
    return _cos_sin(positions.astype(mx.float32).reshape(-1, 1, 1, 1), _inv_freq_table(spec), spec.attention_factor)


@lru_cache(maxsize=16)
def _inv_freq_table(spec: RopeSpec) -> mx.array:
    """[1, 1, dim // 2, 1] float32, built once per table (not one constant per call in every step's graph)."""
    table = mx.array(_inv_freq_np(spec)).reshape(1, 1, -1, 1)
    mx.eval(table)
    return table


@shapeless
def _cos_sin(positions: mx.array, inv_freq: mx.array, attention_factor: float) -> tuple[mx.array, mx.array]:
    """positions: [L, 1, 1, 1] float32, inv_freq: [1, 1, half, 1] -> cos, sin: [L, 1, half, 1], fused."""
    freqs = positions * inv_freq
    return mx.cos(freqs) * attention_factor, mx.sin(freqs) * attention_factor


class StepRope:
    """The RoPE tables of one step's positions, computed once per table and shared by every layer that
    uses it (a model has two tables; without this each layer would build its own, a few nodes each)."""

    def __init__(self, positions: mx.array) -> None:
        self.positions = positions  # [T] int
        self._tables: dict[RopeSpec, tuple[mx.array, mx.array, mx.array]] = {}

    def tables(self, spec: RopeSpec) -> tuple[mx.array, mx.array, mx.array]:
        """-> cos, sin, -sin: [T, 1, dim // 2, 1] float32 (`cos_sin`; -sin undoes the rotation, apply_rope)."""
        got = self._tables.get(spec)
        if got is None:
            cos, sin = cos_sin(spec, self.positions)
            got = self._tables[spec] = (cos, sin, -sin)
        return got


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the trailing 2·half channels of x in interleaved pairs.

    x: [L, ..., D] with the position on axis 0; cos/sin: [L, 1, half, 1] as `cos_sin` gives them
    (or [L, half], at the cost of a reshape). Pass -sin to undo.

    Written for few graph nodes (a decode step runs this ~4 times per layer, docs/BENCHMARKS.md
    "Issue 14, session 6"): each pair (even, odd) and its swapped copy (odd, even) — one reversed
    view of the pairs — meet cos and ±sin in one fused product, instead of slicing the even and odd
    channels apart and stacking them back. The same products and sums as the slice-and-stack form.
    """
    half = cos.shape[-2] if cos.ndim == 4 else cos.shape[-1]
    rope_dim = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (half, 1)  # against pairs [L, .., half, 2]
    if cos.shape != shape:
        cos, sin = cos.reshape(shape), sin.reshape(shape)
    if x.shape[-1] == rope_dim:  # every channel rotates (the indexer's queries and keys)
        return _rotated(x.reshape(*x.shape[:-1], half, 2), cos, sin).reshape(x.shape)
    nope, rope = mx.split(x, [x.shape[-1] - rope_dim], axis=-1)
    rotated = _rotated(rope.reshape(*rope.shape[:-1], half, 2), cos, sin).reshape(rope.shape)
    return mx.concatenate([nope, rotated], axis=-1)


def _rotated(pairs: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """pairs [..., half, 2] -> the rotated pairs; `pairs[..., ::-1]` is (odd, even) per pair."""
    return _rotated_pairs(pairs, pairs[..., ::-1], cos, sin)


_SWAPPED_SIGN = mx.array([-1.0, 1.0], dtype=mx.float32)  # even' = e·cos + o·(−sin), odd' = o·cos + e·sin


@shapeless
def _rotated_pairs(pairs: mx.array, swapped: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """pairs, swapped: [..., half, 2] (x's dtype), cos/sin: [..., half, 1] -> [..., half, 2] rotated
    in float32, back in x's dtype."""
    dtype = pairs.dtype
    return (pairs.astype(mx.float32) * cos + swapped.astype(mx.float32) * (sin * _SWAPPED_SIGN)).astype(dtype)
