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

from tessera.engine.model.compiled import shapeless
from tessera.engine.model.config import RopeSpec


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


@lru_cache(maxsize=16)
def _inv_freq_row(spec: RopeSpec) -> mx.array:
    row = mx.array(_inv_freq_np(spec))[None, :]  # [1, dim // 2]
    mx.eval(row)  # once per table, not a node of every step's graph
    return row


def cos_sin(spec: RopeSpec, positions: mx.array) -> tuple[mx.array, mx.array]:
    """positions: [L] int -> cos, sin: [L, dim // 2] float32 (one angle per interleaved pair)."""
    freqs = positions.astype(mx.float32)[:, None] * _inv_freq_row(spec)
    return mx.cos(freqs) * spec.attention_factor, mx.sin(freqs) * spec.attention_factor


class StepRope:
    """The RoPE tables of one step's positions, computed once per table and shared by every layer that
    uses it (a model has two tables; without this each layer would build its own, a few nodes each)."""

    def __init__(self, positions: mx.array) -> None:
        self.positions = positions  # [T] int
        self._tables: dict[RopeSpec, tuple[mx.array, mx.array, mx.array]] = {}

    def tables(self, spec: RopeSpec) -> tuple[mx.array, mx.array, mx.array]:
        """-> cos, sin, -sin: [T, dim // 2] float32 (-sin undoes the rotation, apply_rope)."""
        got = self._tables.get(spec)
        if got is None:
            cos, sin = cos_sin(spec, self.positions)
            got = self._tables[spec] = (cos, sin, -sin)
        return got


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the trailing 2·cos.shape[-1] channels of x in interleaved pairs.

    x: [L, ..., D] with the position on axis 0; cos/sin: [L, dim // 2]. Pass -sin to undo.
    Splits rather than slices: a decode step calls this a few times per layer, and each split is one
    graph node where the slices and integer indexing it replaces were two or three.
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (half, 1)  # against the pairs' [L, ..., half, 1] halves
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    nope, rope = mx.split(x, [x.shape[-1] - rope_dim], axis=-1)
    even, odd = mx.split(rope.reshape(*rope.shape[:-1], half, 2), 2, axis=-1)  # [L, ..., half, 1] each
    rotated = _rotated_pairs(even, odd, cos, sin).reshape(rope.shape)
    return mx.concatenate([nope, rotated], axis=-1)


@shapeless
def _rotated_pairs(even: mx.array, odd: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """even, odd: [..., half, 1] (x's dtype) -> [..., half, 2] rotated in float32, back in x's dtype."""
    dtype = even.dtype
    even, odd = even.astype(mx.float32), odd.astype(mx.float32)
    return mx.concatenate([(even * cos - odd * sin).astype(dtype), (odd * cos + even * sin).astype(dtype)], axis=-1)
