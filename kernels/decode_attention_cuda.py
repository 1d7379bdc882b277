"""A decode batch's mixed attention (kernels/sparse_attention.py) on tensor cores, in two CUDA kernels: every
token's heads against their window rows and, where the layer has them, their compressed rows (CSA's selected,
HCA's all), plus the head's sink, under one softmax.

Why kernels: on MLX's CUDA backend the reference is ~20 launches a layer at one token — two cuBLAS products a
group (each captured from a stream into a child CUDA graph), the scaling and mask, the concatenation, the
softmax, the split, the casts, the sum of the groups' parts and the copies between them — and a decode step is
bound by the host's encoding of its launches, ~5–7 µs each and ~17 for a captured GEMM (docs/BENCHMARKS.md,
"Session 19"). Here a call is two launches.

Why tensor cores, all of a token's heads together: V4's attention shares one K = V row among all heads, so
the products are [H, d] × [d, R] matrices. Session 19's kernel took 4 heads a block on CUDA cores and read each
row once per block — 16 times a token — which made 16 tokens ~10× slower on the device than cuBLAS (176 against
~15 µs a call). Here each row is read once per head tile from L2 and the products run as `mma.sync` m16n8k16
(bf16 or fp16 in, float32 sums):
- `logits` kernel: a block per (token, 16 rows); each warp a tile of 16 heads, the head dim in steps of 16
  (the A operand the query, the B operand the rows) -> the token's logits [H, R] in float32, rounded to the
  rows' dtype, scaled, -inf where invalid; and each head's max and exp-sum over the block's 16 rows;
- `output` kernel: a block per (token, COLUMNS output columns); first each head's max and normalizer from
  the 16-row tiles' and its sink (a warp a head: a lane's tiles in order, then xor shuffles, lane 0's result),
  then each tile of 16 heads × 32 columns by `row_slices` warps (4 at 64 heads), each a slice of a group's rows
  in steps of 16 (the A operand the probabilities, rounded to the rows' dtype, the B operand the rows), the
  slices' sums added in slice order in shared memory. With one warp a tile (session 20) a token's rows were one
  chain of dependent loads in few warps: slower than MLX on the device at one token and ~3× at sixteen
  (docs/BENCHMARKS.md, "Session 21").
Every sum has one order whatever the batch — a block reads one token's data and its shape does not depend on
the batch — so a token's output is the same bits at every batch size and position in it.

The reference's roundings are kept where it rounds: the product to the rows' dtype (cuBLAS writes it so), then
float32 scaling and masking; probabilities in float32 (MLX's `__expf` and reciprocal normalizer), rounded to
the rows' dtype before their product; each group's part rounded, then the parts added in the rows' dtype. The
tensor cores' sums run in another order than cuBLAS's, so not the reference's bits: the CUDA tests hold the
kernels to a float64 evaluation within the rows' dtype's rounding, and bit for bit across batch sizes
(tests/test_kernels_cuda.py).

Where it runs: decode only (engine/model/decode_attention.py), for bf16 and fp16 rows (the tensor cores' input
types; float32 takes the reference), heads a multiple of 16 up to MAX_HEADS, a head dim a multiple of COLUMNS.
Up to MAX_ATTENDED rows a token: past it the output kernel's blocks (D / COLUMNS a token) each walk every row,
and the reference is faster on the device (session 20, H100, 8,320 rows: 79–97 against 19 µs at one token, 820
against 220 at 16; docs/BENCHMARKS.md); HCA beyond ~213k tokens takes the reference, as it did. Prefill tiles keep the reference
whatever their size, so that a prompt row's output never depends on which tile it lands in
(docs/ARCHITECTURE.md, "Tiling invariants"). The choice depends on the token's own shapes only, never on its
batch.

Switch: TESSERA_DECODE_ATTENTION_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernels
where `is_supported`: CUDA, compilation on — kernels/shapeless.py —, the shapes above).
"""

from __future__ import annotations

import struct
from typing import Sequence

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, on_cuda
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_DECODE_ATTENTION_KERNEL"
_switch = Switch(ENV_VAR, default=True)

TILE = 16  # mma.m16n8k16: a warp's heads (M), and the rows of a step (K); the logits kernel's rows a block
LOGIT_THREADS = 128  # four warps: at V4's 64 heads a head tile each
OUTPUT_WARPS = 16  # the output kernel's warps a block: each (16 heads, COLUMNS) tile's rows split over OUTPUT_WARPS / tiles
# warps (4 at V4's 64 heads); one warp a tile walked all of a token's rows in one chain of dependent loads (session 21)
COLUMNS = 32  # output columns a block of the output kernel: four n8 tiles a warp
MAX_HEADS = 128  # the output kernel's per-head max and normalizer in shared memory
MAX_TOKENS = 65535  # CUDA's grid limit in y, a block row per token: any decode batch (no smaller bound, which
# would give a row other bits in a larger batch)
MAX_ATTENDED = 1792  # rows a token: measured faster than the reference at 640, slower at 8,320 (module docstring)
DTYPES = (mx.bfloat16, mx.float16)  # the tensor cores' input types here

RowGroup = tuple[mx.array, mx.array]  # rows [T, R, d] (K = V), valid [T, R] bool (kernels/sparse_attention.py's too)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def is_supported(q: mx.array, groups: Sequence[RowGroup]) -> bool:
    """q: [T, H, d]; groups of (rows [T, R, d], valid [T, R]): one or two groups of q's dtype."""
    tokens, heads, dim = q.shape
    return (_switch.enabled() and compile_enabled() and on_cuda() and 0 < tokens <= MAX_TOKENS
            and heads % TILE == 0 and heads <= MAX_HEADS and dim % COLUMNS == 0
            and q.dtype in DTYPES and len(groups) in (1, 2)
            and all(rows.dtype == q.dtype and rows.shape[0] == tokens for rows, _ in groups)
            and groups[0][0].shape[1] > 0 and sum(rows.shape[1] for rows, _ in groups) <= MAX_ATTENDED)


_HEADER = r"""
// Two consecutive elements of a row as the 32-bit register an mma operand takes (the lower index in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pair_at(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ uint32_t raw_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t raw_bits(__half x) { return __half_as_ushort(x); }

template <typename T>
__device__ __forceinline__ uint32_t pair_of(T lo, T hi) { return raw_bits(lo) | (raw_bits(hi) << 16); }

// d += a [16 x 16, row-major] * b [16 x 8, column-major], float32 sums (PTX ISA: mma.m16n8k16 fragments; lane =
// 4 g + i: a {(g, 2i..), (g + 8, 2i..), (g, 2i + 8..), (g + 8, 2i + 8..)}, b {(2i.., g), (2i + 8.., g)},
// d {(g, 2i), (g, 2i + 1), (g + 8, 2i), (g + 8, 2i + 1)}).
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Row r of the token's attended rows (the first group's, then the second's), or nullptr past them.
template <typename T, int D>
__device__ __forceinline__ const T* attended_row(const T* rows_a, int count_a, const T* rows_b, int count_b, int t, int r) {
  if (r < count_a) return rows_a + ((size_t)t * count_a + r) * D;
  if (r < count_a + count_b) return rows_b + ((size_t)t * count_b + (r - count_a)) * D;
  return nullptr;
}

// Block (16 rows, token t): logits[t, h, r] = the product q[t, h] . row r rounded to T, times scale in float32;
// -inf where the row is invalid; and each head's max and exp-sum over the block's rows, stats[t, h, block].
// Each warp a tile of 16 heads at a time, the head dim in steps of 16.
template <typename T, int H, int D, int THREADS>
__device__ void tile_logits(const T* q, const T* rows_a, const bool* valid_a, int count_a, const T* rows_b,
                            const bool* valid_b, int count_b, float scale, float* logits, float* stats) {
  constexpr int WARPS = THREADS / 32;
  const int t = blockIdx.y;
  const int r0 = blockIdx.x * 16;
  const int count = count_a + count_b;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int i = lane & 3;
  const T* row[2];  // this lane's B-operand row of each 8-row half: r0 + 8 n + g
  #pragma unroll
  for (int n = 0; n < 2; ++n) row[n] = attended_row<T, D>(rows_a, count_a, rows_b, count_b, t, r0 + 8 * n + g);
  for (int h0 = 16 * (threadIdx.x >> 5); h0 < H; h0 += 16 * WARPS) {
    const T* q_lo = q + ((size_t)t * H + h0 + g) * D + 2 * i;  // head h0 + g
    const T* q_hi = q_lo + 8 * D;  // head h0 + g + 8
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    #pragma unroll 4
    for (int k0 = 0; k0 < D; k0 += 16) {
      const uint32_t a[4] = {pair_at(q_lo + k0), pair_at(q_hi + k0), pair_at(q_lo + k0 + 8), pair_at(q_hi + k0 + 8)};
      #pragma unroll
      for (int n = 0; n < 2; ++n) {
        const uint32_t b[2] = {row[n] ? pair_at(row[n] + k0 + 2 * i) : 0u, row[n] ? pair_at(row[n] + k0 + 8 + 2 * i) : 0u};
        mma(acc[n], a, b, T());
      }
    }
    float value[2][4];  // the logits of this lane's (head, row) pairs, -inf past the rows
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = h0 + g + (e >= 2 ? 8 : 0);
        const int r = r0 + 8 * n + 2 * i + (e & 1);
        value[n][e] = -__int_as_float(0x7f800000);
        if (r < count) {
          const bool ok = r < count_a ? valid_a[(size_t)t * count_a + r] : valid_b[(size_t)t * count_b + (r - count_a)];
          if (ok) value[n][e] = __fmul_rn(static_cast<float>(static_cast<T>(acc[n][e])), scale);
          logits[((size_t)t * H + h) * count + r] = value[n][e];
        }
      }
    }
    // The tile's max and exp-sum for heads h0 + g (e 0, 1) and h0 + g + 8 (e 2, 3): the lane's four values in
    // (n, e) order, then the quad's lanes (xor 1, 2) -> stats[t, h, tile] = (max, sum), written by lane i = 0.
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = fmaxf(fmaxf(value[0][2 * half], value[0][2 * half + 1]), fmaxf(value[1][2 * half], value[1][2 * half + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
      float sum = 0.0f;
      if (m != -__int_as_float(0x7f800000)) {  // a tile without a valid row adds nothing (and exp(-inf + inf) is NaN)
        #pragma unroll
        for (int n = 0; n < 2; ++n) {
          #pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) sum = __fadd_rn(sum, __expf(value[n][e] - m));
        }
      }
      sum = __fadd_rn(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, 1));
      sum = __fadd_rn(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, 2));
      if (i == 0) {
        float* st = stats + (((size_t)t * H + h0 + g + 8 * half) * gridDim.x + blockIdx.x) * 2;
        st[0] = m;
        st[1] = sum;
      }
    }
  }
}

// Each head's max and normalizer's reciprocal from its tiles' (max, exp-sum) [tiles, 2] and its sink: a warp a
// head, a lane's tiles in order, then xor shuffles; lane 0's values (MLX's softmax: __expf, one reciprocal).
template <typename S, int H, int WARPS>
__device__ void head_stats(const float* stats, int tiles, const S* sinks, float* head_max, float* head_inverse) {
  const int lane = threadIdx.x & 31;
  for (int h = threadIdx.x >> 5; h < H; h += WARPS) {
    const float* sh = stats + (size_t)h * tiles * 2;
    const float sink = static_cast<float>(sinks[h]);
    float m = sink;
    for (int j = lane; j < tiles; j += 32) m = fmaxf(m, sh[2 * j]);
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    float e = 0.0f;
    for (int j = lane; j < tiles; j += 32) {
      if (sh[2 * j + 1] > 0.0f) e = __fadd_rn(e, __fmul_rn(sh[2 * j + 1], __expf(sh[2 * j] - m)));
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) e = __fadd_rn(e, __shfl_xor_sync(0xFFFFFFFFu, e, o));
    if (lane == 0) {
      head_max[h] = m;
      head_inverse[h] = 1.0f / __fadd_rn(e, __expf(sink - m));
    }
  }
}

// Probabilities k and k + 1 of a head (rounded to T; 0 past the group's rows) as one A-operand register.
template <typename T>
__device__ __forceinline__ uint32_t prob_pair(const float* lh, int k, int count, float m, float inverse) {
  const T lo = static_cast<T>(k < count ? __fmul_rn(__expf(lh[k] - m), inverse) : 0.0f);
  const T hi = static_cast<T>(k + 1 < count ? __fmul_rn(__expf(lh[k + 1] - m), inverse) : 0.0f);
  return pair_of(lo, hi);
}

// Column c of rows k and k + 1 (0 past the group's rows) as one B-operand register.
template <typename T, int D>
__device__ __forceinline__ uint32_t column_pair(const T* rows, int k, int count, int c) {
  const T zero = static_cast<T>(0.0f);
  return pair_of(k < count ? rows[(size_t)k * D + c] : zero, k + 1 < count ? rows[(size_t)(k + 1) * D + c] : zero);
}

// One row slice's share of a group's part of a (16 heads, 32 columns) tile: the sum, over the slice's steps of 16
// rows (steps slice, slice + SLICES, ...), of probability x row. l_lo / l_hi: heads h0 + g and h0 + g + 8's logits
// at the group's first row; rows: the token's group [count, D].
template <typename T, int D, int SLICES>
__device__ void group_part(const float* l_lo, const float* l_hi, float m_lo, float inv_lo, float m_hi, float inv_hi,
                           const T* rows, int count, int c0, int slice, float (&acc)[4][4]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int i = lane & 3;
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
  }
  #pragma unroll 2
  for (int k0 = 16 * slice; k0 < count; k0 += 16 * SLICES) {
    const int ka = k0 + 2 * i;
    const int kb = ka + 8;
    const uint32_t a[4] = {prob_pair<T>(l_lo, ka, count, m_lo, inv_lo), prob_pair<T>(l_hi, ka, count, m_hi, inv_hi),
                           prob_pair<T>(l_lo, kb, count, m_lo, inv_lo), prob_pair<T>(l_hi, kb, count, m_hi, inv_hi)};
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = c0 + 8 * j + g;
      const uint32_t b[2] = {column_pair<T, D>(rows, ka, count, c), column_pair<T, D>(rows, kb, count, c)};
      mma(acc[j], a, b, T());
    }
  }
}

// A tile's row slices summed in slice order into slice 0's acc (one order whatever the batch). partial: shared,
// [SLICES - 1][TILES][16][32] floats (lane fastest: no bank conflicts). Every warp of the block calls it.
template <int TILES, int SLICES>
__device__ void slice_sum(float (&acc)[4][4], float* partial, int tile, int slice) {
  if (SLICES == 1) return;
  const int lane = threadIdx.x & 31;
  if (slice > 0) {
    float* mine = partial + ((size_t)(slice - 1) * TILES + tile) * 512 + lane;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) mine[(4 * j + e) * 32] = acc[j][e];
    }
  }
  __syncthreads();
  if (slice == 0) {
    for (int s = 1; s < SLICES; ++s) {
      const float* theirs = partial + ((size_t)(s - 1) * TILES + tile) * 512 + lane;
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = __fadd_rn(acc[j][e], theirs[(4 * j + e) * 32]);
      }
    }
  }
  __syncthreads();  // `partial` is free for the next group
}

// Block (COLS columns, token t): the softmax's statistics from the tiles', then each (16 heads, 32 columns) tile
// by SLICES warps, each a slice of the rows (a token's rows in one warp's loop left few warps in flight and a
// long chain of dependent loads: slow at one token and at sixteen); slice 0's warp adds the slices, rounds each
// group's part to T, adds the parts in T -> out[t, h, c].
template <typename T, typename S, int H, int D, int COLS, int SLICES, int GROUPS>
__device__ void tile_output(const float* logits, const float* stats, const T* rows_a, int count_a, const T* rows_b, int count_b,
                            const S* sinks, T* out, float* head_max, float* head_inverse, float* partial) {
  constexpr int HEAD_TILES = H / 16;
  constexpr int TILES = HEAD_TILES * (COLS / 32);
  constexpr int WARPS = TILES * SLICES;
  const int t = blockIdx.y;
  const int count = count_a + count_b;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int i = lane & 3;
  const int tile = (threadIdx.x >> 5) % TILES;
  const int slice = (threadIdx.x >> 5) / TILES;
  const float* lt = logits + (size_t)t * H * count;
  const int tiles = (count + 15) / 16;
  head_stats<S, H, WARPS>(stats + (size_t)t * H * tiles * 2, tiles, sinks, head_max, head_inverse);
  __syncthreads();
  const int h0 = 16 * (tile % HEAD_TILES);
  const int c0 = blockIdx.x * COLS + 32 * (tile / HEAD_TILES);
  const float* l_lo = lt + (size_t)(h0 + g) * count;
  const float* l_hi = l_lo + (size_t)8 * count;
  const float m_lo = head_max[h0 + g], inv_lo = head_inverse[h0 + g];
  const float m_hi = head_max[h0 + g + 8], inv_hi = head_inverse[h0 + g + 8];
  float acc[4][4];
  group_part<T, D, SLICES>(l_lo, l_hi, m_lo, inv_lo, m_hi, inv_hi, rows_a + (size_t)t * count_a * D, count_a, c0, slice, acc);
  slice_sum<TILES, SLICES>(acc, partial, tile, slice);
  T part[4][4];
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) part[j][e] = static_cast<T>(acc[j][e]);
  }
  if (GROUPS == 2) {
    group_part<T, D, SLICES>(l_lo + count_a, l_hi + count_a, m_lo, inv_lo, m_hi, inv_hi, rows_b + (size_t)t * count_b * D,
                             count_b, c0, slice, acc);
    slice_sum<TILES, SLICES>(acc, partial, tile, slice);
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        part[j][e] = static_cast<T>(__fadd_rn(static_cast<float>(part[j][e]), static_cast<float>(static_cast<T>(acc[j][e]))));
      }
    }
  }
  if (slice != 0) return;
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = h0 + g + (e >= 2 ? 8 : 0);
      const int c = c0 + 8 * j + 2 * i + (e & 1);
      out[((size_t)t * H + h) * D + c] = part[j][e];
    }
  }
}
"""

_LOGITS_ONE = r"""
  // q [T, H, D]; rows_a [T, Ra, D], valid_a [T, Ra] -> logits [T, H, Ra], stats [T, H, Ra / 16, 2] float32
  tile_logits<T, H, D, THREADS>(q, rows_a, valid_a, rows_a_shape[1], rows_a, valid_a, 0, __int_as_float(SCALE_BITS), logits,
                                stats);
"""

_LOGITS_TWO = r"""
  // q [T, H, D]; rows_a [T, Ra, D], valid_a [T, Ra]; rows_b [T, Rb, D], valid_b [T, Rb]
  //   -> logits [T, H, Ra + Rb], stats [T, H, (Ra + Rb) / 16, 2] float32
  tile_logits<T, H, D, THREADS>(q, rows_a, valid_a, rows_a_shape[1], rows_b, valid_b, rows_b_shape[1],
                                __int_as_float(SCALE_BITS), logits, stats);
"""

_OUTPUT_ONE = r"""
  // logits [T, H, Ra], stats [T, H, Ra / 16, 2]; rows_a [T, Ra, D]; sinks [H] -> out [T, H, D]
  __shared__ float head_max[H];
  __shared__ float head_inverse[H];
  __shared__ float partial[PARTIAL];
  tile_output<T, S, H, D, COLS, SLICES, 1>(logits, stats, rows_a, rows_a_shape[1], rows_a, 0, sinks, out, head_max, head_inverse,
                                           partial);
"""

_OUTPUT_TWO = r"""
  // logits [T, H, Ra + Rb], stats [T, H, (Ra + Rb) / 16, 2]; rows_a [T, Ra, D]; rows_b [T, Rb, D]; sinks [H] -> out [T, H, D]
  __shared__ float head_max[H];
  __shared__ float head_inverse[H];
  __shared__ float partial[PARTIAL];
  tile_output<T, S, H, D, COLS, SLICES, 2>(logits, stats, rows_a, rows_a_shape[1], rows_b, rows_b_shape[1], sinks, out,
                                           head_max, head_inverse, partial);
"""

_LOGITS_INPUTS = {1: ("q", "rows_a", "valid_a"), 2: ("q", "rows_a", "valid_a", "rows_b", "valid_b")}
_OUTPUT_INPUTS = {1: ("logits", "stats", "rows_a", "sinks"), 2: ("logits", "stats", "rows_a", "rows_b", "sinks")}
_LOGITS_SOURCES = {1: _LOGITS_ONE, 2: _LOGITS_TWO}
_OUTPUT_SOURCES = {1: _OUTPUT_ONE, 2: _OUTPUT_TWO}


def logits_kernel_name(groups: int) -> str:
    return f"tessera_decode_attention_logits_{groups}"


def output_kernel_name(groups: int) -> str:
    return f"tessera_decode_attention_output_{groups}"


def logits_template(dtype: mx.Dtype, heads: int, dim: int, scale: float) -> list[tuple[str, object]]:
    """The logits kernel's compile-time constants; `scale` travels as its float32 bit pattern (a template takes
    integers only), so the kernel multiplies by exactly the float32 the reference multiplies by."""
    (scale_bits,) = struct.unpack("<i", struct.pack("<f", scale))
    return [("T", dtype), ("H", heads), ("D", dim), ("THREADS", LOGIT_THREADS), ("SCALE_BITS", scale_bits)]


_forced_slices: int | None = None


def force_row_slices(slices: int | None) -> None:
    """The output kernel's row slices a tile, for a probe's comparison of layouts (None: `row_slices`' choice). Any
    count gives a token the same bits at every batch size; different counts differ in the last bits."""
    global _forced_slices
    _forced_slices = slices


def row_slices(heads: int) -> int:
    """Warps that share a (16 heads, COLUMNS) tile's rows: a function of the heads only, never of the batch."""
    return _forced_slices or max(1, OUTPUT_WARPS // (heads // TILE * (COLUMNS // 32)))


def output_threads(heads: int) -> int:
    return 32 * heads // TILE * (COLUMNS // 32) * row_slices(heads)


def output_template(dtype: mx.Dtype, sinks_dtype: mx.Dtype, heads: int, dim: int) -> list[tuple[str, object]]:
    slices, tiles = row_slices(heads), heads // TILE * (COLUMNS // 32)
    partial = max(1, (slices - 1) * tiles * 16 * 32)  # floats of the slices' sums in shared memory (kernel `slice_sum`)
    if tiles * slices > 32 or partial * 4 > 40 * 1024:  # a block's 1024 threads; static shared memory's 48 KiB
        raise ValueError(f"{slices} row slices of {tiles} tiles do not fit one block")
    return [("T", dtype), ("S", sinks_dtype), ("H", heads), ("D", dim), ("COLS", COLUMNS), ("SLICES", slices), ("PARTIAL", partial)]


def decode_attention_kernel(q: mx.array, groups: Sequence[RowGroup], sinks: mx.array, scale: float) -> mx.array:
    """q: [T, H, d], groups: one or two (rows [T, R, d], valid [T, R]), sinks: [H] -> [T, H, d], as
    sparse_attention.mixed_attention_reference (where `is_supported`)."""
    tokens, heads, dim = q.shape
    groups = [(rows, valid) for rows, valid in groups if rows.shape[1] > 0]  # the first has rows (`is_supported`)
    count = len(groups)
    attended = sum(rows.shape[1] for rows, _ in groups)
    tiles = -(-attended // TILE)
    logits_kernel = compiled_kernel(logits_kernel_name(count), _LOGITS_INPUTS[count], ("logits", "stats"), _LOGITS_SOURCES[count],
                                    _HEADER)
    logits, stats = logits_kernel(
        inputs=[q] + [a for rows, valid in groups for a in (rows, valid.astype(mx.bool_))],
        template=logits_template(q.dtype, heads, dim, scale),
        grid=(tiles * LOGIT_THREADS, tokens, 1),  # threads, as mx.fast.cuda_kernel counts them: a block per (16 rows, token)
        threadgroup=(LOGIT_THREADS, 1, 1),
        output_shapes=[(tokens, heads, attended), (tokens, heads, tiles, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )  # [T, H, R], [T, H, R / 16, 2]
    output_kernel = compiled_kernel(output_kernel_name(count), _OUTPUT_INPUTS[count], ("out",), _OUTPUT_SOURCES[count], _HEADER)
    (out,) = output_kernel(
        inputs=[logits, stats] + [rows for rows, _ in groups] + [sinks],
        template=output_template(q.dtype, sinks.dtype, heads, dim),
        grid=(dim // COLUMNS * output_threads(heads), tokens, 1),  # a block per (COLUMNS columns, token)
        threadgroup=(output_threads(heads), 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out
