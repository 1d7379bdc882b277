"""V4's MoE block: sqrt-softplus router (learned top-k with a correction bias, or a fixed
token-id → experts table in the first `hash_moe` layers), clamped-SwiGLU experts, one shared expert."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.model.expert_slices import sorted_gather_mm
from engine.model.quantized import QuantizedWeight, Weight, linear
from kernels.cuda import on_cuda


@dataclass(frozen=True)
class MoEWeights:
    router: mx.array  # [E, D]
    correction_bias: mx.array | None  # [E] (learned-routing layers)
    tid2eid: mx.array | None  # [vocab, k] (hash-routing layers)
    w1: Weight  # [E, I, D] gate
    w2: Weight  # [E, D, I] down
    w3: Weight  # [E, I, D] up
    shared_w1: Weight  # [I_shared, D]
    shared_w2: Weight  # [D, I_shared]
    shared_w3: Weight  # [I_shared, D]


def swiglu(x: mx.array, w1: Weight, w2: Weight, w3: Weight, limit: float) -> mx.array:
    """Clamped SwiGLU: gate clamped above, up clamped both sides (V4's swiglu_limit)."""
    gate = mx.minimum(linear(x, w1), limit)
    up = mx.clip(linear(x, w3), -limit, limit)
    return linear(gate * mx.sigmoid(gate) * up, w2)


def _gather_linear(x: mx.array, w: Weight, experts: mx.array) -> mx.array:
    """x: [N, 1, in], experts: [N] sorted ascending -> [N, 1, out]: row n through expert experts[n]."""
    if isinstance(w, QuantizedWeight):
        return mx.gather_qmm(x, w.values, w.scales, w.biases, rhs_indices=experts, transpose=True,
                             group_size=w.group_size, bits=w.bits, mode=w.mode, sorted_indices=True)
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
        # MLX's CPU GatherMM runs float32 only; bf16/fp16 weights are upcast per call (exact)
        out = mx.gather_mm(x.astype(mx.float32), w.swapaxes(-1, -2).astype(mx.float32), rhs_indices=experts, sorted_indices=True)
        return out.astype(x.dtype)
    if on_cuda():  # keeps expert offsets inside MLX CUDA's 32-bit grouped-GEMM range (expert_slices.py)
        return sorted_gather_mm(x, w.swapaxes(-1, -2), experts)
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)


def routed_experts(x: mx.array, experts: mx.array, weights: mx.array, w: MoEWeights, limit: float) -> mx.array:
    """x: [T, D], experts/weights: [T, k] -> [T, D] float32: every (token, slot) pair through its expert.

    Pairs are sorted by expert on the device (no host sync), so each expert's rows are contiguous and
    `gather_mm` / `gather_qmm` run them as one matmul per expert."""
    num_tokens, k = experts.shape
    flat = experts.reshape(-1)  # [T·k]
    order = mx.argsort(flat)  # pair indices, expert-sorted
    sorted_experts = flat[order].astype(mx.uint32)
    rows = x[order // k][:, None, :]  # [T·k, 1, D]
    gate = mx.minimum(_gather_linear(rows, w.w1, sorted_experts), limit)
    up = mx.clip(_gather_linear(rows, w.w3, sorted_experts), -limit, limit)
    out = _gather_linear(gate * mx.sigmoid(gate) * up, w.w2, sorted_experts)  # [T·k, 1, D]
    by_pair = out[mx.argsort(order)].reshape(num_tokens, k, -1)  # back to (token, slot) order
    return (by_pair.astype(mx.float32) * weights[:, :, None]).sum(axis=1)


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
    routed = routed_experts(x, experts, weights, w, limit)
    shared = swiglu(x, w.shared_w1, w.shared_w2, w.shared_w3, limit)
    return (routed.astype(x.dtype) + shared).astype(x.dtype)
