"""Manifold-constrained hyper-connections (mHC): `hc` residual streams per token, collapsed into
one block input and expanded back, mixed by a Sinkhorn-projected doubly-stochastic matrix.

A decode step runs 2 collapses per layer plus the head's, each a few dozen tiny ops (20 Sinkhorn
iterations of 4×4 sums and divisions): most of a decode step's graph. The math lives in pure
functions compiled shapeless (kernels/shapeless.py): their elementwise ops fuse into few
kernels, and the slices and reshapes (which shapeless tracing cannot carry) stay here, outside.
On CUDA decode batches a collapse after its mix logits, and an expand (the MoE's sums in front of
the FFN half's), are one kernel each (kernels/hc_collapse.py, kernels/hc_expand.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx

from tessera.engine.model.moe import RoutedPairs
from tessera.engine.model.norms import rms_norm
from tessera.kernels import hc_collapse as hc_collapse_kernels
from tessera.kernels import hc_expand as hc_expand_kernels
from tessera.kernels import hc_mix as hc_mix_kernels
from tessera.kernels import sinkhorn as sinkhorn_kernels
from tessera.kernels.shapeless import compile_enabled, shapeless


@dataclass(frozen=True)
class HyperWeights:
    """A layer's mixing weights (shapes below), or the head's: fn [hc, hc·hidden], base [hc], scale [1]
    (pre mixes only, `head_collapse`)."""

    fn: mx.array  # [(2 + hc)·hc, hc·hidden]
    base: mx.array  # [(2 + hc)·hc]
    scale: mx.array  # [3]: pre, post, comb

    @cached_property
    def hc(self) -> int:
        mixes = self.base.shape[0]
        return next(h for h in range(1, mixes + 1) if (2 + h) * h == mixes)

    @cached_property
    def scale_per_mix(self) -> mx.array:
        """[(2 + hc)·hc] float32: scale[0] over the pre mixes, scale[1] over post, scale[2] over comb,
        so one elementwise product scales every mix (no slicing inside a compiled function)."""
        hc, s = self.hc, self.scale.astype(mx.float32)
        per_mix = mx.concatenate([mx.broadcast_to(s[0], (hc,)), mx.broadcast_to(s[1], (hc,)), mx.broadcast_to(s[2], (hc * hc,))])
        mx.eval(per_mix)  # once per layer, not in every step's graph
        return per_mix

    @cached_property
    def fn32(self) -> mx.array:
        """[(2 + hc)·hc, hc·hidden] float32: `fn` cast once per layer (the mixing kernel's operand), not in
        every step's graph. Costs a float32 copy of `fn` where the checkpoint's is narrower (~1.5 MiB a
        matrix at V4 Flash's widths)."""
        return _evaluated(self.fn.astype(mx.float32))

    @cached_property
    def fn_t32(self) -> mx.array:
        """[hc·hidden, (2 + hc)·hc] float32: `fn32` transposed (a strided view of it, the operand the
        per-step `fn.astype(float32).T` gave the gemm). Evaluated here like every cached form: a view left
        lazy would be evaluated later on whatever thread first reads it, with the stream of the thread that
        made it (MLX: "There is no Stream(cpu, N) in current thread")."""
        return _evaluated(self.fn32.T)

    @cached_property
    def base32(self) -> mx.array:
        return _evaluated(self.base.astype(mx.float32))

    @cached_property
    def scale32(self) -> mx.array:
        return _evaluated(self.scale.astype(mx.float32))

    def prime(self) -> None:
        """Makes every cached form above now: each evaluates when made, which a compiled trace that
        uses them must not do inside (engine/model/compiled.py, StepCompiled)."""
        _ = self.fn32, self.fn_t32, self.base32, self.scale32
        if self.scale.shape[0] == 3:  # a layer's mixes (pre, post, comb); the head's are pre only
            _ = self.scale_per_mix


def _evaluated(a: mx.array) -> mx.array:
    mx.eval(a)
    return a


def block_input(streams: mx.array, w: HyperWeights, norm_weight: mx.array, sinkhorn_iters: int, hc_eps: float,
                norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """streams: [T, hc, D] -> (post [T, hc, 1], mix_t [T, hc, hc], the block's normed input [T, D]): `hyper_weights`
    with its collapsed sum RMS-normed by the block's norm weight. On CUDA decode batches what follows the mix logits
    is one kernel (kernels/hc_collapse.py)."""
    if hc_collapse_kernels.is_supported(streams):
        logits = _mixes(streams.reshape(streams.shape[0], -1), w, w.scale_per_mix, norm_eps)  # [T, (2 + hc)·hc, 1]
        return hc_collapse_kernels.collapse_kernel(logits, streams, norm_weight, sinkhorn_iters, hc_eps, norm_eps)
    post, mix_t, collapsed = hyper_weights(streams, w, sinkhorn_iters, hc_eps, norm_eps)
    return post, mix_t, rms_norm(collapsed, norm_weight, norm_eps)


def hyper_weights(streams: mx.array, w: HyperWeights, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """streams: [T, hc, D] -> (post [T, hc, 1], mix_t [T, hc, hc], collapsed block input [T, D]); mix_t is the
    doubly stochastic comb transposed (mix_t[t, k, j] = comb[t, j, k]) in the streams' dtype, as `expand` reads it.

    The mixes come out as [T, mixes, 1], so pre and post are split off already shaped to scale
    [T, hc, D] streams (one node for the three parts and none to expand pre and post)."""
    num_tokens, hc, _ = streams.shape
    logits = _mixes(streams.reshape(num_tokens, -1), w, w.scale_per_mix, norm_eps)  # [T, (2 + hc)·hc, 1]
    pre_logits, post_logits, comb_logits = mx.split(logits, [hc, 2 * hc], axis=1)  # one node, not three slices
    pre, post, probs = _coefficients(pre_logits, post_logits, comb_logits.reshape(num_tokens, hc, hc), hc_eps)
    return post, _mixing(probs, streams, sinkhorn_iters, hc_eps), _collapse(pre, streams)


_mix_logits = shapeless(hc_mix_kernels.mix_logits_reference)


def _mixes(flat: mx.array, w: HyperWeights, scale: mx.array, norm_eps: float) -> mx.array:
    """flat: [T, hc·D] -> [T, mixes, 1] float32: normed streams through the mixing weights, scaled
    (`scale`: [mixes] or [1]), biased. One CUDA kernel for a decode batch where supported, else the
    reference, compiled when compilation is on (kernels/hc_mix.py)."""
    if hc_mix_kernels.is_supported(flat):
        return hc_mix_kernels.mix_logits_kernel(flat, w.fn32, scale, w.base32, norm_eps)
    return _mix_logits(flat, w.fn_t32, scale, w.base32, norm_eps)


_coefficients = shapeless(hc_collapse_kernels.coefficients)


@shapeless
def _mixing_compiled(probs: mx.array, streams: mx.array, iters: int, eps: float) -> mx.array:
    """`mixing_reference` in the streams' dtype (`streams` passes only its dtype: a compiled function takes
    no dtype argument)."""
    return sinkhorn_kernels.mixing_reference(probs, iters, eps, streams.dtype)


def _mixing(probs: mx.array, streams: mx.array, iters: int, eps: float) -> mx.array:
    """probs [T, hc, hc] -> mix_t [T, hc, hc] in the streams' dtype (`hyper_weights`): one CUDA kernel where
    supported (compilation on), else the reference, compiled when compilation is on (kernels/sinkhorn.py)."""
    if compile_enabled() and sinkhorn_kernels.is_supported(probs):
        return sinkhorn_kernels.mixing_kernel(probs, iters, eps, streams.dtype)
    return _mixing_compiled(probs, streams, iters, eps)


_collapse = shapeless(hc_collapse_kernels.weighted_sum)


_expand = shapeless(hc_expand_kernels.expand_reference)


def expand(block_out: mx.array, streams: mx.array, post: mx.array, mix_t: mx.array) -> mx.array:
    """new[k] = post[k]·out + Σ_j comb[j, k]·streams[j]; block_out: [T, D], streams: [T, hc, D],
    post: [T, hc, 1] and mix_t [T, hc, hc] (`hyper_weights`: mix_t[k, j] = comb[j, k], in the streams' dtype).
    One CUDA kernel for a decode batch where supported (kernels/hc_expand.py)."""
    if hc_expand_kernels.block_out_is_supported(block_out, streams):
        return hc_expand_kernels.expand_kernel(block_out, streams, post, mix_t)
    return _expand(block_out, streams, post, mix_t)


def expand_pairs(pairs: RoutedPairs, like: mx.array, streams: mx.array, post: mx.array, mix_t: mx.array) -> mx.array:
    """`expand` of the MoE's output (`pairs.output(like)`, like: the block input): on CUDA decode batches the MoE's
    sums and the expand are one kernel (kernels/hc_expand.py)."""
    if hc_expand_kernels.pairs_are_supported(pairs.rows, pairs.weights, pairs.shared, streams):
        return hc_expand_kernels.expand_pairs_kernel(pairs.rows, pairs.weights, pairs.shared, streams, post, mix_t)
    return expand(pairs.output(like), streams, post, mix_t)


def head_input(streams: mx.array, w: HyperWeights, norm_weight: mx.array, hc_eps: float, norm_eps: float) -> mx.array:
    """The vocabulary projection's input: `head_collapse` RMS-normed by the output norm's weight, [T, hc, D] -> [T, D].
    On CUDA decode batches what follows the mix logits is one kernel (kernels/hc_collapse.py)."""
    if hc_collapse_kernels.is_supported(streams):
        mixes = _mixes(streams.reshape(streams.shape[0], -1), w, w.scale32, norm_eps)  # [T, hc, 1]
        return hc_collapse_kernels.head_kernel(mixes, streams, norm_weight, hc_eps, norm_eps)
    return rms_norm(head_collapse(streams, w, hc_eps, norm_eps), norm_weight, norm_eps)


def head_collapse(streams: mx.array, w: HyperWeights, hc_eps: float, norm_eps: float) -> mx.array:
    """Final collapse of the streams before the output norm: [T, hc, D] -> [T, D]. `w` holds the
    head's hc mixes (pre only): fn [hc, hc·D], base [hc], scale [1]."""
    mixes = _mixes(streams.reshape(streams.shape[0], -1), w, w.scale32, norm_eps)  # [T, hc, 1]
    return _head_weighted(mixes, streams, hc_eps)


_head_weighted = shapeless(hc_collapse_kernels.head_weighted_sum)
