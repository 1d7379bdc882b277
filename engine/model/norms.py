"""RMS norms as V4 uses them: weighted (norm layers) and unweighted (per-head q norm, hyper-connections).
Both compiled shapeless (kernels/shapeless.py): the dtype casts around the statistics fuse."""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.shapeless import shapeless


@shapeless
def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x: [..., D], weight: [D] -> [..., D]; statistics in float32."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)


@shapeless
def unweighted_rms_norm(x: mx.array, eps: float) -> mx.array:
    """x: [..., D] -> x · rsqrt(mean(x²) + eps), in float32. `mx.fast.rms_norm` without a weight: one
    primitive on a GPU instead of a square, a sum, an element count and the fused rest (the same bits
    as that per-op form on the CPU, tests/test_compiled.py)."""
    return mx.fast.rms_norm(x.astype(mx.float32), None, eps).astype(x.dtype)
