"""A decode batch's mixed attention (kernels/sparse_attention.py) as one CUDA kernel: every token's heads
against their window rows and, where the layer has them, their compressed rows (CSA's selected, HCA's
all), plus the head's sink, under one softmax.

Why a kernel: on MLX's CUDA backend the reference is ~20 launches a layer at one token — two cuBLAS
products a group (each captured from a stream into a child CUDA graph), the scaling and mask, the
concatenation, the softmax, the split, the casts, the sum of the groups' parts and the copies between
them — and a decode step is bound by the host's encoding of its launches, ~5–7 µs each and more for a
captured GEMM (docs/BENCHMARKS.md, "What one graph node costs MLX's CUDA backend"; "Session 19").

Layout: a block of THREADS threads per (token, head). Phase 1, a warp a row at a time (rows r ≡ warp
mod WARPS): the lanes' fused multiply-adds over the head dim in a fixed order, then xor shuffles: the
row's product. Phase 2: the block's max and exp-sum over the products and the sink, in a fixed order.
Phase 3, two output columns a thread: the probabilities times the rows, row by row. Every sum has one
order whatever the batch, so a token's output is the same bits at every batch size and position in it.

The reference's roundings are kept where it rounds: the product to the rows' dtype (cuBLAS writes it
so), then float32 scaling and masking; probabilities in float32 (MLX's `__expf` and reciprocal
normalizer), rounded to the rows' dtype before their product; each group's part rounded, then the
parts added in the rows' dtype. The products' own sums run in another order than cuBLAS's, so not the
reference's bits: the CUDA tests hold it to a float64 evaluation within the rows' dtype's rounding, and
bit for bit across batch sizes (tests/test_kernels_cuda.py).

Where it runs: decode only (engine/model/decode_attention.py), up to MAX_ATTENDED rows a token. Prefill tiles keep the reference whatever their size, so that a prompt row's output never
depends on which tile it lands in (docs/ARCHITECTURE.md, "Tiling invariants"). Beyond MAX_ATTENDED (HCA
past ~520k tokens) a block reading every row twice would be slower than cuBLAS; the reference runs, and
the choice depends on the token's own row count only, never on its batch.

Switch: TESSERA_DECODE_ATTENTION_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernel
where `is_supported`: CUDA, compilation on — kernels/shapeless.py —, the sizes above, a head dim a
multiple of 64).
"""

from __future__ import annotations

import struct
from typing import Sequence

import mlx.core as mx

from tessera.kernels.cuda import SHARED_MEMORY_LIMIT, compiled_kernel, on_cuda
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_DECODE_ATTENTION_KERNEL"
_switch = Switch(ENV_VAR, default=True)

THREADS = 256  # a block: eight warps, one (token, head)
MAX_TOKENS = 65535  # CUDA's grid limit in y, a block row per token: any decode batch (no smaller bound, which
# would give a row other bits in a larger batch)
MAX_ATTENDED = 2048  # rows a token (window + compressed): the block's float32 logits in shared memory
assert MAX_ATTENDED * 4 <= SHARED_MEMORY_LIMIT

RowGroup = tuple[mx.array, mx.array]  # rows [T, R, d] (K = V), valid [T, R] bool


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def is_supported(q: mx.array, groups: Sequence[RowGroup]) -> bool:
    """q: [T, H, d]; groups of (rows [T, R, d], valid [T, R]): one or two groups of q's dtype."""
    tokens, _, dim = q.shape
    return (_switch.enabled() and compile_enabled() and on_cuda() and 0 < tokens <= MAX_TOKENS and dim % 64 == 0
            and q.dtype in (mx.bfloat16, mx.float16, mx.float32) and len(groups) in (1, 2)
            and all(rows.dtype == q.dtype and rows.shape[0] == tokens for rows, _ in groups)
            and groups[0][0].shape[1] > 0 and sum(rows.shape[1] for rows, _ in groups) <= MAX_ATTENDED)


_HEADER = r"""
// The block's reduction of one value a thread, in a fixed order: a warp's by xor shuffles, then the warps' in
// warp order, read by every thread from shared memory (the same bits in each).
template <int WARPS, bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* partial) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = MAX ? fmaxf(v, other) : __fadd_rn(v, other);
  }
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = partial[0];
  #pragma unroll
  for (int k = 1; k < WARPS; ++k) total = MAX ? fmaxf(total, partial[k]) : __fadd_rn(total, partial[k]);
  __syncthreads();  // every thread has read partial before a second call writes it
  return total;
}

template <typename T>
struct alignas(2 * sizeof(T)) Pair { T v[2]; };  // two consecutive elements of a row, one load

template <typename T>
__device__ __forceinline__ Pair<T> pair_at(const T* p) { return *reinterpret_cast<const Pair<T>*>(p); }

constexpr int ROWS_IN_FLIGHT = 4;  // a warp's rows loaded together: the block is one per SM, latency needs hiding

// Phase 1 for one group: each warp's rows' products with the head's query (lane order fixed: element pairs
// 64 i + 2 lane, i ascending, then the xor shuffles), rounded to T as the reference's product is, scaled in
// float32, -inf where invalid -> logits[r].
template <typename T, int D, int WARPS>
__device__ __forceinline__ void group_logits(const float (&qv)[D / 32], const T* rows, const bool* valid, int count,
                                             float scale, float* logits) {
  const int lane = threadIdx.x & 31;
  for (int first = threadIdx.x >> 5; first < count; first += ROWS_IN_FLIGHT * WARPS) {
    float acc[ROWS_IN_FLIGHT];
    #pragma unroll
    for (int u = 0; u < ROWS_IN_FLIGHT; ++u) acc[u] = 0.0f;
    #pragma unroll
    for (int i = 0; i < D / 64; ++i) {
      #pragma unroll
      for (int u = 0; u < ROWS_IN_FLIGHT; ++u) {
        const int r = first + u * WARPS;
        if (r < count) {
          const Pair<T> x = pair_at(rows + (size_t)r * D + 64 * i + 2 * lane);
          acc[u] = fmaf(qv[2 * i], static_cast<float>(x.v[0]), acc[u]);
          acc[u] = fmaf(qv[2 * i + 1], static_cast<float>(x.v[1]), acc[u]);
        }
      }
    }
    #pragma unroll
    for (int u = 0; u < ROWS_IN_FLIGHT; ++u) {
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[u] = __fadd_rn(acc[u], __shfl_xor_sync(0xFFFFFFFFu, acc[u], o));
      const int r = first + u * WARPS;
      if (lane == 0 && r < count) {
        logits[r] = valid[r] ? __fmul_rn(static_cast<float>(static_cast<T>(acc[u])), scale) : -__int_as_float(0x7f800000);  // -inf
      }
    }
  }
}

// Phase 3 for one group: columns c, c + 1 of the probabilities (already rounded to T) times the rows, row order.
template <typename T, int D>
__device__ __forceinline__ void group_part(const T* rows, int count, const float* probs, int c, float& a0, float& a1) {
  a0 = 0.0f;
  a1 = 0.0f;
  #pragma unroll 8
  for (int r = 0; r < count; ++r) {
    const float p = probs[r];
    const Pair<T> x = pair_at(rows + (size_t)r * D + c);
    a0 = fmaf(p, static_cast<float>(x.v[0]), a0);
    a1 = fmaf(p, static_cast<float>(x.v[1]), a1);
  }
}

// One (token, head): GROUPS groups of rows (a: the window; b: the compressed rows, if any), the sink, one softmax.
template <typename T, typename S, int D, int THREADS, int GROUPS>
__device__ void attend(const T* q, const T* rows_a, const bool* valid_a, int count_a, const T* rows_b,
                       const bool* valid_b, int count_b, const S* sinks, float scale, T* out, float* logits,
                       float* partial) {
  constexpr int WARPS = THREADS / 32;
  const int h = blockIdx.x;
  const int t = blockIdx.y;
  const int heads = gridDim.x;
  const int lane = threadIdx.x & 31;
  const T* qh = q + ((size_t)t * heads + h) * D;
  float qv[D / 32];
  #pragma unroll
  for (int i = 0; i < D / 64; ++i) {
    const Pair<T> x = pair_at(qh + 64 * i + 2 * lane);
    qv[2 * i] = static_cast<float>(x.v[0]);
    qv[2 * i + 1] = static_cast<float>(x.v[1]);
  }
  rows_a += (size_t)t * count_a * D;
  valid_a += (size_t)t * count_a;
  group_logits<T, D, WARPS>(qv, rows_a, valid_a, count_a, scale, logits);
  if (GROUPS == 2) {
    rows_b += (size_t)t * count_b * D;
    valid_b += (size_t)t * count_b;
    group_logits<T, D, WARPS>(qv, rows_b, valid_b, count_b, scale, logits + count_a);
  }
  __syncthreads();
  const int count = count_a + (GROUPS == 2 ? count_b : 0);
  const float sink = static_cast<float>(sinks[h]);
  float m = sink;
  for (int r = threadIdx.x; r < count; r += THREADS) m = fmaxf(m, logits[r]);
  m = block_reduce<WARPS, true>(m, partial);
  float e = 0.0f;
  for (int r = threadIdx.x; r < count; r += THREADS) e = __fadd_rn(e, __expf(logits[r] - m));
  const float normalizer = __fadd_rn(block_reduce<WARPS, false>(e, partial), __expf(sink - m));
  const float inverse = 1.0f / normalizer;
  for (int r = threadIdx.x; r < count; r += THREADS) {
    logits[r] = static_cast<float>(static_cast<T>(__fmul_rn(__expf(logits[r] - m), inverse)));
  }
  __syncthreads();
  T* oh = out + ((size_t)t * heads + h) * D;
  for (int c = 2 * threadIdx.x; c < D; c += 2 * THREADS) {
    float a0, a1;
    group_part<T, D>(rows_a, count_a, logits, c, a0, a1);
    T o0 = static_cast<T>(a0);
    T o1 = static_cast<T>(a1);
    if (GROUPS == 2) {
      float b0, b1;
      group_part<T, D>(rows_b, count_b, logits + count_a, c, b0, b1);
      o0 = static_cast<T>(__fadd_rn(static_cast<float>(o0), static_cast<float>(static_cast<T>(b0))));
      o1 = static_cast<T>(__fadd_rn(static_cast<float>(o1), static_cast<float>(static_cast<T>(b1))));
    }
    oh[c] = o0;
    oh[c + 1] = o1;
  }
}
"""

_SOURCE_ONE = r"""
  // q [T, H, D]; rows_a [T, Ra, D], valid_a [T, Ra]; sinks [H] -> out [T, H, D]
  __shared__ float logits[MAX_ATTENDED];
  __shared__ float partial[THREADS / 32];
  attend<T, S, D, THREADS, 1>(q, rows_a, valid_a, rows_a_shape[1], rows_a, valid_a, 0, sinks,
                              __int_as_float(SCALE_BITS), out, logits, partial);
"""

_SOURCE_TWO = r"""
  // q [T, H, D]; rows_a [T, Ra, D], valid_a [T, Ra]; rows_b [T, Rb, D], valid_b [T, Rb]; sinks [H] -> out [T, H, D]
  __shared__ float logits[MAX_ATTENDED];
  __shared__ float partial[THREADS / 32];
  attend<T, S, D, THREADS, 2>(q, rows_a, valid_a, rows_a_shape[1], rows_b, valid_b, rows_b_shape[1], sinks,
                              __int_as_float(SCALE_BITS), out, logits, partial);
"""

_INPUTS = {1: ("q", "rows_a", "valid_a", "sinks"), 2: ("q", "rows_a", "valid_a", "rows_b", "valid_b", "sinks")}
_SOURCES = {1: _SOURCE_ONE, 2: _SOURCE_TWO}


def kernel_name(groups: int) -> str:
    return f"tessera_decode_attention_{groups}"


def kernel_template(dtype: mx.Dtype, sinks_dtype: mx.Dtype, dim: int, scale: float) -> list[tuple[str, object]]:
    """The kernel's compile-time constants; `scale` travels as its float32 bit pattern (a template takes integers
    only), so the kernel multiplies by exactly the float32 the reference multiplies by."""
    (scale_bits,) = struct.unpack("<i", struct.pack("<f", scale))
    return [("T", dtype), ("S", sinks_dtype), ("D", dim), ("THREADS", THREADS), ("MAX_ATTENDED", MAX_ATTENDED),
            ("SCALE_BITS", scale_bits)]


def decode_attention_kernel(q: mx.array, groups: Sequence[RowGroup], sinks: mx.array, scale: float) -> mx.array:
    """q: [T, H, d], groups: one or two (rows [T, R, d], valid [T, R]), sinks: [H] -> [T, H, d], as
    sparse_attention.mixed_attention_reference (where `is_supported`)."""
    tokens, heads, dim = q.shape
    groups = [(rows, valid) for rows, valid in groups if rows.shape[1] > 0]  # the first has rows (`is_supported`)
    count = len(groups)
    kernel = compiled_kernel(kernel_name(count), _INPUTS[count], ("out",), _SOURCES[count], _HEADER)
    operands = [q] + [a for rows, valid in groups for a in (rows, valid.astype(mx.bool_))] + [sinks]
    (out,) = kernel(
        inputs=operands,
        template=kernel_template(q.dtype, sinks.dtype, dim, scale),
        grid=(heads * THREADS, tokens, 1),  # threads, as mx.fast.cuda_kernel counts them: a block per (head, token)
        threadgroup=(THREADS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out
