"""Manifold-constrained hyper-connections (mHC): `hc` residual streams per token, collapsed into
one block input and expanded back, mixed by a Sinkhorn-projected doubly-stochastic matrix."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.model.norms import unweighted_rms_norm


@dataclass(frozen=True)
class HyperWeights:
    fn: mx.array  # [(2 + hc)·hc, hc·hidden]
    base: mx.array  # [(2 + hc)·hc]
    scale: mx.array  # [3]: pre, post, comb


def hyper_weights(streams: mx.array, w: HyperWeights, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """streams: [T, hc, D] -> (post [T, hc], comb [T, hc, hc], collapsed block input [T, D])."""
    num_tokens, hc, _ = streams.shape
    flat = unweighted_rms_norm(streams.reshape(num_tokens, -1).astype(mx.float32), norm_eps)
    mixes = flat @ w.fn.astype(mx.float32).T  # [T, (2 + hc)·hc]
    base, scale = w.base.astype(mx.float32), w.scale.astype(mx.float32)
    pre = mx.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * mx.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb_logits = mixes[:, 2 * hc :].reshape(num_tokens, hc, hc) * scale[2] + base[2 * hc :].reshape(hc, hc)
    comb = _sinkhorn(mx.softmax(comb_logits, axis=-1, precise=True) + hc_eps, sinkhorn_iters, hc_eps)
    collapsed = (pre[..., None] * streams).sum(axis=1).astype(streams.dtype)
    return post, comb, collapsed


def _sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Alternate column and row normalization (columns first, as the reference does)."""
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def expand(block_out: mx.array, streams: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """new[k] = post[k]·out + Σ_j comb[j, k]·streams[j]; block_out: [T, D], streams: [T, hc, D]."""
    dtype = streams.dtype
    mixed = comb.astype(dtype).transpose(0, 2, 1) @ streams  # [T, hc, D]
    return post.astype(dtype)[..., None] * block_out[:, None, :] + mixed


def head_collapse(streams: mx.array, fn: mx.array, base: mx.array, scale: mx.array, hc_eps: float, norm_eps: float):
    """Final collapse of the streams before the output norm: [T, hc, D] -> [T, D]."""
    num_tokens = streams.shape[0]
    flat = unweighted_rms_norm(streams.reshape(num_tokens, -1).astype(mx.float32), norm_eps)
    mixes = flat @ fn.astype(mx.float32).T  # [T, hc]
    pre = mx.sigmoid(mixes * scale.astype(mx.float32) + base.astype(mx.float32)) + hc_eps
    return (pre[..., None] * streams).sum(axis=1).astype(streams.dtype)
