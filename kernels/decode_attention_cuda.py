"""A decode batch's mixed attention (kernels/sparse_attention.py) as one CUDA kernel: every token's heads
against their window rows and, where the layer has them, their compressed rows (CSA's selected, HCA's
all), plus the head's sink, under one softmax.

Why a kernel: on MLX's CUDA backend the reference is ~20 launches a layer at one token — two cuBLAS
products a group (each captured from a stream into a child CUDA graph), the scaling and mask, the
concatenation, the softmax, the split, the casts, the sum of the groups' parts and the copies between
them — and a decode step is bound by the host's encoding of its launches, ~5–7 µs each and more for a
captured GEMM (docs/BENCHMARKS.md, "What one graph node costs MLX's CUDA backend"; "Session 19").

Layout: a block of THREADS threads per (token, HB heads: `heads_per_block`). Phase 1, each warp LOGIT_ROWS
rows at a time (rows r ≡ warp mod WARPS), each row loaded once for the block's heads: a lane's fused
multiply-adds over its 16-byte pieces of the head dim in a fixed order, then xor shuffles: a (row, head)'s
product. Phase 2, a head at a time: the block's max and exp-sum over the products and the sink, in a fixed
order. Phase 3, a group at a time: each warp sums its rows' probability-weighted values over the whole head
dim (row order) for each head, then the warps' sums are added in warp order. Every sum has one order whatever
the batch or the heads a block, so a token's output is the same bits at every batch size and position in it.

What it costs (H200, V4 Flash's CSA shapes, docs/BENCHMARKS.md "Session 19"): the host encodes a call in
~35–50 µs against the reference's ~160–200; the device runs it in ~4 µs at one token, but ~176 µs at 16
tokens against the reference's ~15: every block reads its token's rows for its own heads (16 blocks a token),
where cuBLAS reads them once for all 64. A decode step is host-bound at both sizes on the hosts measured: at
one sequence the step is faster with the kernel, at 16 the difference was within the hosts' noise. A kernel
taking all of a token's heads through tensor cores would remove the device cost at larger batches.

The reference's roundings are kept where it rounds: the product to the rows' dtype (cuBLAS writes it
so), then float32 scaling and masking; probabilities in float32 (MLX's `__expf` and reciprocal
normalizer), rounded to the rows' dtype before their product; each group's part rounded, then the
parts added in the rows' dtype. The products' own sums run in another order than cuBLAS's, so not the
reference's bits: the CUDA tests hold it to a float64 evaluation within the rows' dtype's rounding, and
bit for bit across batch sizes (tests/test_kernels_cuda.py).

Where it runs: decode only (engine/model/decode_attention.py), up to MAX_ATTENDED rows a token. Prefill
tiles keep the reference whatever their size, so that a prompt row's output never depends on which tile it
lands in (docs/ARCHITECTURE.md, "Tiling invariants"). Beyond MAX_ATTENDED (HCA past ~213k tokens: each
head's logits must fit in shared memory) the reference runs; the choice depends on the token's own row count
only, never on its batch.

Switch: TESSERA_DECODE_ATTENTION_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernel
where `is_supported`: CUDA, compilation on — kernels/shapeless.py —, the sizes above, a head dim a
multiple of THREADS up to MAX_DIM).
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

THREADS = 256  # a block: eight warps, one token and `heads_per_block` heads; the head dim a multiple of it (V4: 512)
VECTOR = 8  # elements a lane loads at once (16 bytes of bf16); a warp's 32 loads cover 256 of a row
MAX_TOKENS = 65535  # CUDA's grid limit in y, a block row per token: any decode batch (no smaller bound, which
# would give a row other bits in a larger batch)
MAX_ATTENDED = 1792  # rows a token (window + compressed): each head's float32 logits in shared memory
MAX_DIM = 1024  # the head dim: each warp's float32 sums of the output in shared memory beside the logits
HEADS_PER_BLOCK = (4, 2, 1)  # a block's heads, most first: each row is read once for all of them


def heads_per_block(heads: int, dim: int) -> int:
    """Four heads a block where they fit (shared memory for their logits and the warps' sums; a divisor of the
    heads): on the H200, at V4's CSA shapes, 4.1 µs a call at one token against 8.7 with a head a block (more
    blocks, but each reading its token's rows again), and 176 against 287 µs at 16 tokens (docs/BENCHMARKS.md,
    "Session 19"). A (token, head)'s sums are the same whatever the heads a block, so this never changes a bit."""
    return next(hb for hb in HEADS_PER_BLOCK if heads % hb == 0 and _shared_bytes(hb, dim) <= SHARED_MEMORY_LIMIT)


def _shared_bytes(hb: int, dim: int) -> int:
    return (hb * MAX_ATTENDED + (THREADS // 32) * dim + THREADS // 32) * 4


assert _shared_bytes(1, MAX_DIM) <= SHARED_MEMORY_LIMIT and _shared_bytes(4, 512) <= SHARED_MEMORY_LIMIT

RowGroup = tuple[mx.array, mx.array]  # rows [T, R, d] (K = V), valid [T, R] bool (kernels/sparse_attention.py's too)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def is_supported(q: mx.array, groups: Sequence[RowGroup]) -> bool:
    """q: [T, H, d]; groups of (rows [T, R, d], valid [T, R]): one or two groups of q's dtype."""
    tokens, _, dim = q.shape
    return (_switch.enabled() and compile_enabled() and on_cuda() and 0 < tokens <= MAX_TOKENS
            and dim % THREADS == 0 and dim <= MAX_DIM
            and q.dtype in (mx.bfloat16, mx.float16, mx.float32) and len(groups) in (1, 2)
            and all(rows.dtype == q.dtype and rows.shape[0] == tokens for rows, _ in groups)
            and groups[0][0].shape[1] > 0 and sum(rows.shape[1] for rows, _ in groups) <= MAX_ATTENDED)


_HEADER = r"""
// V consecutive elements of a row: one vector load (V = 8: 16 bytes of bf16).
template <typename T, int V>
struct alignas(V * sizeof(T)) Vec { T v[V]; };

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> vec_at(const T* p) { return *reinterpret_cast<const Vec<T, V>*>(p); }

// A warp's rows loaded together (one block per SM at one token: the loads' latency needs hiding in the warp).
constexpr int LOGIT_ROWS = 8;
constexpr int OUTPUT_ROWS = 4;  // fewer where each row feeds HB heads' sums (registers)

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

// Phase 1 for one group: each warp's rows (r = warp mod WARPS) times the block's HB heads' queries. A lane holds
// the V elements at 32 V i + V lane, i ascending; a (row, head)'s products in that order, then the xor shuffles,
// whatever HB. Rounded to T as the reference's product is, scaled in float32, -inf where invalid ->
// logits[hb * STRIDE + r] (STRIDE: a head's room, MAX_ATTENDED).
template <typename T, int D, int V, int WARPS, int HB, int STRIDE>
__device__ __forceinline__ void group_logits(const float (&qv)[HB][D / 32], const T* rows, const bool* valid,
                                             int count, float scale, float* logits) {
  constexpr int CHUNKS = D / (32 * V);
  const int lane = threadIdx.x & 31;
  for (int first = threadIdx.x >> 5; first < count; first += LOGIT_ROWS * WARPS) {
    Vec<T, V> x[LOGIT_ROWS][CHUNKS];
    #pragma unroll
    for (int u = 0; u < LOGIT_ROWS; ++u) {
      const int r = first + u * WARPS;
      #pragma unroll
      for (int i = 0; i < CHUNKS; ++i) {
        if (r < count) x[u][i] = vec_at<T, V>(rows + (size_t)r * D + 32 * V * i + V * lane);
      }
    }
    #pragma unroll
    for (int u = 0; u < LOGIT_ROWS; ++u) {
      const int r = first + u * WARPS;
      #pragma unroll
      for (int hb = 0; hb < HB; ++hb) {
        float acc = 0.0f;
        if (r < count) {
          #pragma unroll
          for (int i = 0; i < CHUNKS; ++i) {
            #pragma unroll
            for (int j = 0; j < V; ++j) acc = fmaf(qv[hb][V * i + j], static_cast<float>(x[u][i].v[j]), acc);
          }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, o));
        if (lane == 0 && r < count) {
          logits[hb * STRIDE + r] =
              valid[r] ? __fmul_rn(static_cast<float>(static_cast<T>(acc)), scale) : -__int_as_float(0x7f800000);
        }
      }
    }
  }
}

// Phase 2 for one head: its logits -> probabilities rounded to T (MLX's softmax: __expf, one reciprocal), in place.
template <typename T, int THREADS>
__device__ __forceinline__ void softmax_with_sink(float* logits, int count, float sink, float* partial) {
  constexpr int WARPS = THREADS / 32;
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
}

// Phase 3 for one group: the probabilities (rounded to T) times the rows. Each warp sums its rows
// (r = warp mod WARPS, row order) over the lane's columns 32 V i + V lane + j, for each of the HB heads; then,
// a head at a time, the warps' sums are added in warp order -> the group's part rounded to T, columns
// c = threadIdx.x + THREADS k of the head's output. A (row, head)'s terms and their order do not depend on HB.
template <typename T, int D, int V, int WARPS, int HB, int STRIDE>
__device__ __forceinline__ void group_part(const T* rows, int count, const float* probs, float* sums,
                                           T (&part)[HB][D / (32 * WARPS)]) {
  constexpr int CHUNKS = D / (32 * V);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float acc[HB][D / 32];
  #pragma unroll
  for (int hb = 0; hb < HB; ++hb) {
    #pragma unroll
    for (int k = 0; k < D / 32; ++k) acc[hb][k] = 0.0f;
  }
  for (int first = warp; first < count; first += OUTPUT_ROWS * WARPS) {
    Vec<T, V> x[OUTPUT_ROWS][CHUNKS];
    #pragma unroll
    for (int u = 0; u < OUTPUT_ROWS; ++u) {
      const int r = first + u * WARPS;
      #pragma unroll
      for (int i = 0; i < CHUNKS; ++i) {
        if (r < count) x[u][i] = vec_at<T, V>(rows + (size_t)r * D + 32 * V * i + V * lane);
      }
    }
    #pragma unroll
    for (int u = 0; u < OUTPUT_ROWS; ++u) {
      const int r = first + u * WARPS;
      if (r < count) {
        #pragma unroll
        for (int hb = 0; hb < HB; ++hb) {
          const float p = probs[hb * STRIDE + r];
          #pragma unroll
          for (int i = 0; i < CHUNKS; ++i) {
            #pragma unroll
            for (int j = 0; j < V; ++j) acc[hb][V * i + j] = fmaf(p, static_cast<float>(x[u][i].v[j]), acc[hb][V * i + j]);
          }
        }
      }
    }
  }
  #pragma unroll
  for (int hb = 0; hb < HB; ++hb) {
    #pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      #pragma unroll
      for (int j = 0; j < V; ++j) sums[warp * D + 32 * V * i + V * lane + j] = acc[hb][V * i + j];
    }
    __syncthreads();
    #pragma unroll
    for (int k = 0; k < D / (32 * WARPS); ++k) {
      const int c = threadIdx.x + 32 * WARPS * k;
      float total = sums[c];
      #pragma unroll
      for (int w = 1; w < WARPS; ++w) total = __fadd_rn(total, sums[w * D + c]);
      part[hb][k] = static_cast<T>(total);
    }
    __syncthreads();  // every thread has read sums before they are written again
  }
}

// One token, HB consecutive heads: GROUPS groups of rows (a: the window; b: the compressed rows, if any), each
// head's sink, one softmax a head.
template <typename T, typename S, int D, int V, int THREADS, int HB, int STRIDE, int GROUPS>
__device__ void attend(const T* q, const T* rows_a, const bool* valid_a, int count_a, const T* rows_b,
                       const bool* valid_b, int count_b, const S* sinks, float scale, T* out, float* logits,
                       float* sums, float* partial) {
  constexpr int WARPS = THREADS / 32;
  constexpr int CHUNKS = D / (32 * V);
  const int h0 = blockIdx.x * HB;
  const int t = blockIdx.y;
  const int heads = gridDim.x * HB;
  const int lane = threadIdx.x & 31;
  float qv[HB][D / 32];
  #pragma unroll
  for (int hb = 0; hb < HB; ++hb) {
    const T* qh = q + ((size_t)t * heads + h0 + hb) * D;
    #pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const Vec<T, V> x = vec_at<T, V>(qh + 32 * V * i + V * lane);
      #pragma unroll
      for (int j = 0; j < V; ++j) qv[hb][V * i + j] = static_cast<float>(x.v[j]);
    }
  }
  rows_a += (size_t)t * count_a * D;
  valid_a += (size_t)t * count_a;
  group_logits<T, D, V, WARPS, HB, STRIDE>(qv, rows_a, valid_a, count_a, scale, logits);
  if (GROUPS == 2) {
    rows_b += (size_t)t * count_b * D;
    valid_b += (size_t)t * count_b;
    group_logits<T, D, V, WARPS, HB, STRIDE>(qv, rows_b, valid_b, count_b, scale, logits + count_a);
  }
  __syncthreads();
  const int count = count_a + (GROUPS == 2 ? count_b : 0);
  #pragma unroll
  for (int hb = 0; hb < HB; ++hb) {
    softmax_with_sink<T, THREADS>(logits + hb * STRIDE, count, static_cast<float>(sinks[h0 + hb]), partial);
  }
  __syncthreads();
  T part[HB][D / THREADS];
  group_part<T, D, V, WARPS, HB, STRIDE>(rows_a, count_a, logits, sums, part);
  if (GROUPS == 2) {
    T other[HB][D / THREADS];
    group_part<T, D, V, WARPS, HB, STRIDE>(rows_b, count_b, logits + count_a, sums, other);
    #pragma unroll
    for (int hb = 0; hb < HB; ++hb) {
      #pragma unroll
      for (int k = 0; k < D / THREADS; ++k) {
        part[hb][k] = static_cast<T>(__fadd_rn(static_cast<float>(part[hb][k]), static_cast<float>(other[hb][k])));
      }
    }
  }
  #pragma unroll
  for (int hb = 0; hb < HB; ++hb) {
    T* oh = out + ((size_t)t * heads + h0 + hb) * D;
    #pragma unroll
    for (int k = 0; k < D / THREADS; ++k) oh[threadIdx.x + THREADS * k] = part[hb][k];
  }
}
"""

_SOURCE_ONE = r"""
  // q [T, H, D]; rows_a [T, Ra, D], valid_a [T, Ra]; sinks [H] -> out [T, H, D]
  __shared__ float logits[HB * MAX_ATTENDED];
  __shared__ float sums[(THREADS / 32) * D];
  __shared__ float partial[THREADS / 32];
  attend<T, S, D, V, THREADS, HB, MAX_ATTENDED, 1>(q, rows_a, valid_a, rows_a_shape[1], rows_a, valid_a, 0, sinks,
                                     __int_as_float(SCALE_BITS), out, logits, sums, partial);
"""

_SOURCE_TWO = r"""
  // q [T, H, D]; rows_a [T, Ra, D], valid_a [T, Ra]; rows_b [T, Rb, D], valid_b [T, Rb]; sinks [H] -> out [T, H, D]
  __shared__ float logits[HB * MAX_ATTENDED];
  __shared__ float sums[(THREADS / 32) * D];
  __shared__ float partial[THREADS / 32];
  attend<T, S, D, V, THREADS, HB, MAX_ATTENDED, 2>(q, rows_a, valid_a, rows_a_shape[1], rows_b, valid_b, rows_b_shape[1], sinks,
                                     __int_as_float(SCALE_BITS), out, logits, sums, partial);
"""

_INPUTS = {1: ("q", "rows_a", "valid_a", "sinks"), 2: ("q", "rows_a", "valid_a", "rows_b", "valid_b", "sinks")}
_SOURCES = {1: _SOURCE_ONE, 2: _SOURCE_TWO}


def kernel_name(groups: int) -> str:
    return f"tessera_decode_attention_{groups}"


def kernel_template(dtype: mx.Dtype, sinks_dtype: mx.Dtype, dim: int, scale: float, hb: int) -> list[tuple[str, object]]:
    """The kernel's compile-time constants; `scale` travels as its float32 bit pattern (a template takes integers
    only), so the kernel multiplies by exactly the float32 the reference multiplies by."""
    (scale_bits,) = struct.unpack("<i", struct.pack("<f", scale))
    return [("T", dtype), ("S", sinks_dtype), ("D", dim), ("V", VECTOR), ("THREADS", THREADS), ("HB", hb),
            ("MAX_ATTENDED", MAX_ATTENDED), ("SCALE_BITS", scale_bits)]


def decode_attention_kernel(q: mx.array, groups: Sequence[RowGroup], sinks: mx.array, scale: float) -> mx.array:
    """q: [T, H, d], groups: one or two (rows [T, R, d], valid [T, R]), sinks: [H] -> [T, H, d], as
    sparse_attention.mixed_attention_reference (where `is_supported`)."""
    tokens, heads, dim = q.shape
    groups = [(rows, valid) for rows, valid in groups if rows.shape[1] > 0]  # the first has rows (`is_supported`)
    count = len(groups)
    kernel = compiled_kernel(kernel_name(count), _INPUTS[count], ("out",), _SOURCES[count], _HEADER)
    operands = [q] + [a for rows, valid in groups for a in (rows, valid.astype(mx.bool_))] + [sinks]
    hb = heads_per_block(heads, dim)
    (out,) = kernel(
        inputs=operands,
        template=kernel_template(q.dtype, sinks.dtype, dim, scale, hb),
        grid=(heads // hb * THREADS, tokens, 1),  # threads, as mx.fast.cuda_kernel counts them: a block per (hb heads, token)
        threadgroup=(THREADS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out
