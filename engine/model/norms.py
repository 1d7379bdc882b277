"""RMS norms as V4 uses them: weighted (norm layers) and unweighted (per-head q norm, hyper-connections).
Both compiled shapeless (engine/model/compiled.py): the dtype casts around the statistics fuse."""

from __future__ import annotations

import mlx.core as mx

from tessera.engine.model.compiled import shapeless


@shapeless
def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x: [..., D], weight: [D] -> [..., D]; statistics in float32."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)


@shapeless
def unweighted_rms_norm(x: mx.array, eps: float) -> mx.array:
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
