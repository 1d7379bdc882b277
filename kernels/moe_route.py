"""The MoE router's work after its matmul (engine/model/moe.py `route`): a plain-MLX reference and, for MLX's CUDA
backend, one kernel for a decode batch's tokens.

From a token's router logits l ([E] float32, `x.astype(float32) @ router_t`) the router makes
- scores = sqrt(softplus(l)) = sqrt(logaddexp(l, 0)), [E] float32;
- experts, [k] uint32: in learned layers the k largest of scores + bias (the correction bias, float32), as
  `argpartition(-(scores + bias))[:k]` picks them; in the first hash-routed layers the token's row of the
  token -> experts table (`tid2eid[token_id]`, held in uint32);
- weights, [k] float32: the chosen experts' scores (unbiased) normalized to sum to `scaling`:
  w / (sum(w) + 1e-20) · scaling.
This module owns that math: `route_reference` and `hash_route_reference` are the engine's path where the kernels do
not run (moe.py compiles the same functions shapeless: `scores`, `negated_biased`, `normalized`), the same bits.

Why a kernel: in MLX that is seven graph nodes a layer after the matmul (the fused score, the fused negated bias,
ArgPartition, the Slice of its first k, GatherAxis, the weights' Sum and the fused normalize; six in a hash layer,
the table's Gather and Squeeze instead of the three top-k nodes), and MLX's CUDA backend pays a host cost per node
(~6 µs, docs/BENCHMARKS.md "Session 28 on an H100") in a batch-1 decode step bound by the host. With the kernel
(one node) the tiny preset's CUDA-path step (docs/bench/cuda_standin.py; 2 learned, 2 hash layers) builds 22 nodes
fewer (436 -> 414 when written); V4 Flash's, 40 learned and 3 hash layers, 255 fewer. On an H100 its CUDA tests
pass, and in one process every 64k batch-1 round without it was 0.09-0.21 ms slower than every round with it
(docs/BENCHMARKS.md, "Session 37").
Here it is one launch: a block per token, a thread per expert.
Each thread computes its expert's score (MLX's LogAddExp at y = 0: max + log1p(exp(min - max)), the infinities
as MLX has them, then sqrt), puts its biased value in shared memory and counts its rank:
  rank(e) = #{j : b_j > b_e, or b_j == b_e and j < e},
so the k experts of rank < k are the k largest, and expert e writes slot rank(e): the slots in descending biased
order, ties to the lower expert index (the reference's argpartition leaves the order of its k, and which of an
exact tie it takes, to the implementation: only the set is held to the reference). Then each of the first k
threads sums the k chosen scores in slot order and writes its slot's weight: `__fdiv_rn`, `__fadd_rn` and
`__fmul_rn` with the float32s the reference uses (1e-20 and the scaling travel as their bit patterns). The hash
kernel is the same without the rank: a lane per slot reads its expert from the table, in the table's order.

A token's outputs depend on its own row only (the ranks compare within the row, the sums run in slot order): the
same bits at every batch size. Not the reference's bits (MLX sums the k weights in its own order and its exp and
log1p may round otherwise): the CUDA tests hold the experts to the reference's as sets and the weights within a
few float32 ulps (tests/test_kernels_cuda.py). Comparisons use an order-preserving integer key (kernels/topk_cuda
.py's): the float order, -0 as +0, and a total order with a NaN in the row, so each slot is still written once.

Where it runs: decode batches (up to MAX_ROWS tokens; CUDA; compilation on), E up to 1,024 (a block's threads,
rounded up to whole warps: V4's 256 exactly, the tiny preset's 4 in one warp), k up to 32 (a warp's lanes; V4:
k = 6). A prefill chunk keeps MLX's ops: there seven nodes a layer are nothing against the chunk's work.

Switch: TESSERA_MOE_ROUTE_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernel where it is
supported).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, float_bits, on_cuda
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_MOE_ROUTE_KERNEL"
_switch = Switch(ENV_VAR, default=True)

MAX_ROWS = 64  # tokens a call: a decode batch (hc_mix.MAX_ROWS's bound)
MAX_EXPERTS = 1024  # a thread an expert: a block's most threads
MAX_TOP_K = 32  # a lane a slot in the hash kernel's warp
TINY = 1e-20  # added to the weights' sum before the division (a token whose chosen scores are all 0)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def router_logits(x: mx.array, router_t: mx.array) -> mx.array:
    """x [T, D], router_t [D, E] (moe.MoEWeights.router_t) -> [T, E] float32: the router's product."""
    return x.astype(mx.float32) @ router_t.astype(mx.float32)


def scores(logits: mx.array) -> mx.array:
    """[T, E] float32 -> [T, E] float32: sqrt(softplus(logits)), the routing scores."""
    return mx.sqrt(mx.logaddexp(logits, 0.0))


def negated_biased(scores: mx.array, bias: mx.array) -> mx.array:
    """[T, E], bias [E] -> [T, E] float32: -(scores + bias), whose k smallest (argpartition's) are the k largest
    biased scores."""
    return -(scores + bias.astype(mx.float32))


def normalized(weights: mx.array, scaling: float) -> mx.array:
    """[T, k] -> [T, k]: the chosen scores over their sum (plus TINY), times `scaling`."""
    return weights / (weights.sum(axis=-1, keepdims=True) + TINY) * scaling


def route_reference(logits: mx.array, bias: mx.array, top_k: int, scaling: float) -> tuple[mx.array, mx.array]:
    """A learned layer's routing: logits [T, E] float32, bias [E] -> (experts [T, k] uint32, weights [T, k] float32)."""
    s = scores(logits)  # [T, E]
    experts = mx.argpartition(negated_biased(s, bias), kth=top_k - 1, axis=-1)[:, :top_k]  # [T, k] uint32
    return experts, normalized(mx.take_along_axis(s, experts, axis=-1), scaling)


def hash_route_reference(logits: mx.array, tid2eid: mx.array, token_ids: mx.array,
                         scaling: float) -> tuple[mx.array, mx.array]:
    """A hash layer's routing: logits [T, E] float32, tid2eid [vocab, k] (held in uint32), token_ids [T] -> (experts
    [T, k] in the table's dtype, in its order, weights [T, k] float32)."""
    experts = tid2eid[token_ids]  # [T, k]
    return experts, normalized(mx.take_along_axis(scores(logits), experts, axis=-1), scaling)


def is_supported(logits: mx.array, top_k: int) -> bool:
    """Whether the kernels take these logits ([T, E]) and k: shapes, dtype and switches only."""
    if logits.ndim != 2:
        return False
    rows, experts = logits.shape
    return (_switch.enabled() and compile_enabled() and on_cuda() and 0 < rows <= MAX_ROWS
            and 0 < experts <= MAX_EXPERTS and 0 < top_k <= min(experts, MAX_TOP_K) and logits.dtype == mx.float32)


_HEADER = r"""
// sqrt(softplus(x)): MLX's LogAddExp (backend/cuda/device/binary_ops.cuh) at y = 0, NaN and the infinities as
// there (softplus(-inf) = 0, softplus(inf) = inf), then the rounded sqrt.
__device__ __forceinline__ float router_score(float x) {
  if (isnan(x)) return x;
  const float hi = fmaxf(x, 0.0f);
  const float lo = fminf(x, 0.0f);
  const float softplus = (isinf(lo) || isinf(hi)) ? hi : __fadd_rn(hi, log1pf(expf(__fsub_rn(lo, hi))));
  return sqrtf(softplus);
}

// Order-preserving map float -> uint32 (kernels/topk_cuda.py's): larger float, larger key; -0 as +0.
__device__ __forceinline__ unsigned int route_key(float f) {
  const unsigned int bits = __float_as_uint(f == 0.f ? 0.f : f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Slot `slot`'s weight: its score over the K chosen scores' sum (in slot order) plus TINY, times the scaling.
template <int K>
__device__ __forceinline__ float slot_weight(const float* picked, int slot, float tiny, float scaling) {
  float sum = picked[0];
  #pragma unroll
  for (int k = 1; k < K; ++k) sum = __fadd_rn(sum, picked[k]);
  return __fmul_rn(__fdiv_rn(picked[slot], __fadd_rn(sum, tiny)), scaling);
}
"""

# Learned routing: a block a token, a thread an expert.
_SOURCE = r"""
  // logits [T, E] float32, bias [E] B -> experts [T, K] uint32, weights [T, K] float32. The block: E threads rounded
  // up to whole warps (`block_threads`); those past E only meet the barriers.
  __shared__ unsigned int keys[E];
  __shared__ float picked[K];  // the chosen scores by slot
  const int t = blockIdx.x;
  const int e = threadIdx.x;
  const bool expert = e < E;
  const float score = expert ? router_score(logits[(size_t)t * E + e]) : 0.0f;
  const unsigned int mine = expert ? route_key(__fadd_rn(score, static_cast<float>(bias[e]))) : 0u;
  if (expert) keys[e] = mine;
  __syncthreads();
  int rank = E;  // experts ahead of e: larger biased value, or tied and lower index
  if (expert) {
    rank = 0;
    for (int j = 0; j < E; ++j) {
      const unsigned int other = keys[j];
      rank += (other > mine) || (other == mine && j < e);
    }
  }
  if (rank < K) {  // the ranks are a permutation of 0 … E-1: each slot written once
    experts[(size_t)t * K + rank] = (uint32_t)e;
    picked[rank] = score;
  }
  __syncthreads();
  const float tiny = __int_as_float(TINY_BITS), scaling = __int_as_float(SCALING_BITS);
  if (e < K) weights[(size_t)t * K + e] = slot_weight<K>(picked, e, tiny, scaling);  // K <= E: an expert's thread
"""

# Hash routing: a block (one warp) a token, a lane a slot.
_HASH_SOURCE = r"""
  // logits [T, E] float32, tid2eid [vocab, K] M, token_ids [T] I -> experts [T, K] uint32, weights [T, K] float32.
  // The table's experts are the checkpoint's, each below E.
  __shared__ float picked[K];
  const int t = blockIdx.x;
  const int slot = threadIdx.x;
  if (slot < K) {
    const uint32_t e = static_cast<uint32_t>(tid2eid[(size_t)token_ids[t] * K + slot]);
    experts[(size_t)t * K + slot] = e;
    picked[slot] = router_score(logits[(size_t)t * E + e]);
  }
  __syncthreads();
  const float tiny = __int_as_float(TINY_BITS), scaling = __int_as_float(SCALING_BITS);
  if (slot < K) weights[(size_t)t * K + slot] = slot_weight<K>(picked, slot, tiny, scaling);
"""

KERNEL_NAME = "tessera_moe_route"
HASH_KERNEL_NAME = "tessera_moe_hash_route"
INPUTS = ("logits", "bias")
HASH_INPUTS = ("logits", "tid2eid", "token_ids")
OUTPUTS = ("experts", "weights")


def kernel_template(num_experts: int, top_k: int, scaling: float) -> list[tuple[str, int | mx.Dtype]]:
    """The constants both kernels share; 1e-20 and the scaling travel as their float32 bit patterns (a template
    takes integers and types only), so the kernel adds and multiplies exactly the float32s the reference does."""
    return [("E", num_experts), ("K", top_k), ("TINY_BITS", float_bits(TINY)), ("SCALING_BITS", float_bits(scaling))]


def block_threads(num_experts: int) -> int:
    """The learned kernel's block: a thread an expert, in whole warps."""
    return -(-num_experts // 32) * 32


def route_kernel(logits: mx.array, bias: mx.array, top_k: int, scaling: float) -> tuple[mx.array, mx.array]:
    """`route_reference`'s experts (as a set; here in descending biased order) and weights in one launch, on a CUDA
    device (`is_supported`)."""
    rows, num_experts = logits.shape
    threads = block_threads(num_experts)
    kernel = compiled_kernel(KERNEL_NAME, INPUTS, OUTPUTS, _SOURCE, _HEADER)
    experts, weights = kernel(
        inputs=[logits, bias],
        template=[("B", bias.dtype)] + kernel_template(num_experts, top_k, scaling),
        grid=(rows * threads, 1, 1),  # threads, as mx.fast.cuda_kernel counts them: a block a token
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, top_k), (rows, top_k)],
        output_dtypes=[mx.uint32, mx.float32],
    )
    return experts, weights


def hash_route_kernel(logits: mx.array, tid2eid: mx.array, token_ids: mx.array,
                      scaling: float) -> tuple[mx.array, mx.array]:
    """`hash_route_reference`'s experts (uint32) and weights in one launch, on a CUDA device (`is_supported`, with
    k the table's width)."""
    rows, num_experts = logits.shape
    top_k = tid2eid.shape[1]
    kernel = compiled_kernel(HASH_KERNEL_NAME, HASH_INPUTS, OUTPUTS, _HASH_SOURCE, _HEADER)
    experts, weights = kernel(
        inputs=[logits, tid2eid, token_ids],
        template=[("M", tid2eid.dtype), ("I", token_ids.dtype)] + kernel_template(num_experts, top_k, scaling),
        grid=(rows * 32, 1, 1),  # a warp a token
        threadgroup=(32, 1, 1),
        output_shapes=[(rows, top_k), (rows, top_k)],
        output_dtypes=[mx.uint32, mx.float32],
    )
    return experts, weights
