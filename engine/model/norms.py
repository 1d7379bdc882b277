"""RMS norms as V4 uses them: weighted (norm layers) and unweighted (per-head q norm), statistics in float32.
bf16 and fp16 rows on CUDA take one kernel where TESSERA_RMS_NORM_KERNEL=1 (kernels/rms_norm_cuda.py: the casts
around MLX's norm are two more launches a norm); elsewhere the reference, compiled shapeless (kernels/shapeless.py)."""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels import rms_norm_cuda
from tessera.kernels.shapeless import shapeless

# Each reference compiled whole (no tessera function inside: a compiled replay calls none, a plain run would)
_weighted_reference = shapeless(rms_norm_cuda.rms_norm_reference)
_unweighted_reference = shapeless(rms_norm_cuda.unweighted_rms_norm_reference)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x: [..., D], weight: [D] -> [..., D] in x's dtype."""
    if rms_norm_cuda.is_supported(x):
        return rms_norm_cuda.rms_norm_kernel(x, weight, eps)
    return _weighted_reference(x, weight, eps)


def unweighted_rms_norm(x: mx.array, eps: float) -> mx.array:
    """x: [..., D] -> x · rsqrt(mean(x²) + eps) in x's dtype."""
    if rms_norm_cuda.is_supported(x):
        return rms_norm_cuda.rms_norm_kernel(x, None, eps)
    return _unweighted_reference(x, eps)
