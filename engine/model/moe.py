"""V4's MoE block: sqrt-softplus router (learned top-k with a correction bias, or a fixed
token-id → experts table in the first `hash_moe` layers), clamped-SwiGLU experts, one shared expert."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class MoEWeights:
    router: mx.array  # [E, D]
    correction_bias: mx.array | None  # [E] (learned-routing layers)
    tid2eid: mx.array | None  # [vocab, k] (hash-routing layers)
    w1: mx.array  # [E, I, D] gate
    w2: mx.array  # [E, D, I] down
    w3: mx.array  # [E, I, D] up
    shared_w1: mx.array  # [I_shared, D]
    shared_w2: mx.array  # [D, I_shared]
    shared_w3: mx.array  # [I_shared, D]


def swiglu(x: mx.array, w1: mx.array, w2: mx.array, w3: mx.array, limit: float) -> mx.array:
    """Clamped SwiGLU: gate clamped above, up clamped both sides (V4's swiglu_limit)."""
    gate = mx.minimum(x @ w1.T, limit)
    up = mx.clip(x @ w3.T, -limit, limit)
    return (gate * mx.sigmoid(gate) * up) @ w2.T


def route(x: mx.array, token_ids: mx.array, w: MoEWeights, top_k: int, scaling: float) -> tuple[mx.array, mx.array]:
    """x: [T, D] -> (experts [T, k] int, weights [T, k]) from sqrt(softplus(logits))."""
    scores = mx.sqrt(mx.logaddexp(x.astype(mx.float32) @ w.router.astype(mx.float32).T, 0.0))  # [T, E]
    if w.tid2eid is not None:
        experts = w.tid2eid[token_ids].astype(mx.int32)
    else:
        biased = scores + w.correction_bias.astype(mx.float32)
        experts = mx.argpartition(-biased, kth=top_k - 1, axis=-1)[:, :top_k].astype(mx.int32)
    weights = mx.take_along_axis(scores, experts, axis=-1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * scaling
    return experts, weights


def moe(x: mx.array, token_ids: mx.array, w: MoEWeights, top_k: int, scaling: float, limit: float) -> mx.array:
    """x: [T, D] -> [T, D]: routed experts (each run once on the tokens routed to it) + shared expert."""
    experts, weights = route(x, token_ids, w, top_k, scaling)
    experts_np = np.array(experts)  # host copy: groups tokens by expert
    routed = mx.zeros(x.shape, dtype=mx.float32)
    for e in np.unique(experts_np):
        tokens, slots = np.nonzero(experts_np == e)
        tokens_mx = mx.array(tokens)
        out = swiglu(x[tokens_mx], w.w1[int(e)], w.w2[int(e)], w.w3[int(e)], limit)
        routed = routed.at[tokens_mx].add(out.astype(mx.float32) * weights[tokens_mx, mx.array(slots)][:, None])
    shared = swiglu(x, w.shared_w1, w.shared_w2, w.shared_w3, limit)
    return (routed.astype(x.dtype) + shared).astype(x.dtype)
