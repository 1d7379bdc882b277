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
~15 µs a call). Here the products run as `mma.sync` m16n8k16 (bf16 or fp16 in, float32 sums), all of a token's
heads against each row it stages:
- `logits` kernel: a block per (token, 32 rows), eight warps; the head dim in staged steps of 64: the block's
  16-byte loads of the next step's q [H, 64] and rows [32, 64] run while its warps multiply this step's from
  shared memory (a warp a unit of 16 heads × 16 rows) -> the token's products [H, R] rounded to the rows' dtype
  (-inf where invalid; the output kernel scales them as the logits are scaled here: the same float32 from half
  the bytes); and each head's max and exp-sum of the logits over each 16-row tile;
- `output` kernel: a block per (token, COLUMNS output columns, `block_heads` heads), a warp a tile of 16 heads ×
  32 columns; first its heads' max and normalizer from the tiles' and the sinks (all of a warp's heads' tiles
  loaded at once), then the rows in staged steps of 64: the next step's rows [64, COLUMNS] and products
  [heads, 64] load while the warps multiply this step's probabilities (computed once a step, by the thread that
  stages them, rounded to the rows' dtype) by its rows.
Sessions 20–22's layouts loaded each operand straight from global memory into the mma's registers, a few
scalar loads at a time: latency-bound, 3–8× MLX's device time at 16 tokens; staged, ~1.3× (docs/BENCHMARKS.md,
"Session 22", "Session 23").
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
and the reference was faster on the device (session 20's layout, H100, 8,320 rows: 79–97 against 19 µs at one
token, 820 against 220 at 16; docs/BENCHMARKS.md); HCA beyond ~213k tokens takes the reference, as it did. Prefill tiles keep the reference
whatever their size, so that a prompt row's output never depends on which tile it lands in
(docs/ARCHITECTURE.md, "Tiling invariants"). The choice depends on the token's own shapes only, never on its
batch.

Switch: TESSERA_DECODE_ATTENTION_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernels
where `is_supported`: CUDA, compilation on — kernels/shapeless.py —, the shapes above).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, float_bits, on_cuda
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_DECODE_ATTENTION_KERNEL"
_switch = Switch(ENV_VAR, default=True)

TILE = 16  # mma.m16n8k16: a warp's heads (M) and the rows or columns of a unit
THREADS = 256  # the logits kernel's: eight warps, a step's loads spread over all of them
LOGIT_ROWS = 32  # the logits kernel's rows a block: two 16-row tiles
COLUMNS = 64  # the output kernel's columns a block (two 32-column tiles), and the logits kernel's head-dim step
OUTPUT_ROWS = 64  # the output kernel's rows a staged step
OUTPUT_HEADS = 64  # the output kernel's heads a block (where they divide the heads, else 16): at V4's 64 a block a
# (token, 64 columns), eight warps; 32 (two blocks, four warps each) measured slower at 16 tokens (docs/BENCHMARKS.md, "Session 23")
MAX_HEADS = 128  # the logits kernel's two staged q steps [H, 64 + 8] in bf16: 36 KiB of the 48 shared
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


_KERNELS = r"""
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

// 16 bytes (8 elements) of a row as one register set; zeros for nullptr (past the rows). `aligned`: the kernel's
// input buffers start on 16 bytes (MLX's allocations do; a view's offset need not), else 8 element loads.
template <typename T>
__device__ __forceinline__ uint4 load8(const T* p, bool aligned) {
  uint4 v;
  if (p == nullptr) {
    v.x = v.y = v.z = v.w = 0u;
  } else if (aligned) {
    v = *reinterpret_cast<const uint4*>(p);
  } else {
    v.x = pair_of(p[0], p[1]); v.y = pair_of(p[2], p[3]); v.z = pair_of(p[4], p[5]); v.w = pair_of(p[6], p[7]);
  }
  return v;
}

__device__ __forceinline__ bool all_aligned(const void* a, const void* b, const void* c) {
  return ((reinterpret_cast<size_t>(a) | reinterpret_cast<size_t>(b) | reinterpret_cast<size_t>(c)) & 15) == 0;
}

// Two consecutive 16-bit elements of a shared array as one 32-bit operand register (their address is 4-byte aligned).
__device__ __forceinline__ uint32_t shared_pair(const unsigned short* p) { return *reinterpret_cast<const uint32_t*>(p); }

constexpr int PAD = 8;  // each shared row 16 bytes longer: a fragment's loads hit 32 distinct banks

// Block (32 rows, token t): products[t, h, r] = q[t, h] . row r rounded to T (-inf where the row is invalid: the
// output kernel scales it as the logit here is scaled, the same float32, from half the bytes a float32 would
// take); and each head's max and exp-sum over each 16-row tile of the logits (the product times scale in float32),
// stats[t, h, tile].
// The head dim in staged steps of CHUNK: the next step's q [H, CHUNK] and rows [32, CHUNK] load (16 bytes a
// thread, coalesced) while the warps multiply this step's from shared memory. Warp w takes (16 heads, 16 rows)
// units w, w + 8, ...; a unit's sums run over the head dim in one order.
template <typename T, int H, int D>
__device__ void tile_logits(const T* q, const T* rows_a, const bool* valid_a, int count_a, const T* rows_b,
                            const bool* valid_b, int count_b, float scale, T* products, float* stats) {
  constexpr int HEAD_TILES = H / 16;
  constexpr int UNITS = HEAD_TILES * (LOGIT_ROWS / 16);
  constexpr int PER_WARP = (UNITS + 7) / 8;
  constexpr int Q_VECTORS = H * CHUNK / 8;  // 16-byte pieces of a step's q
  constexpr int Q_LOADS = (Q_VECTORS + THREADS - 1) / THREADS;
  constexpr int STEPS = D / CHUNK;
  __shared__ __align__(16) unsigned short q_s[2][H][CHUNK + PAD];
  __shared__ __align__(16) unsigned short r_s[2][LOGIT_ROWS][CHUNK + PAD];
  const int t = blockIdx.y;
  const int r0 = blockIdx.x * LOGIT_ROWS;
  const int count = count_a + count_b;
  const int tiles = (count + 15) / 16;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, i = threadIdx.x & 3;  // lane = 4 g + i (the fragments')
  const bool aligned = all_aligned(q, rows_a, rows_b);
  const T* q_t = q + (size_t)t * H * D;
  const int my_row = threadIdx.x / 8;  // the row and 8 columns of a step this thread stages
  const int my_col = 8 * (threadIdx.x % 8);
  const T* row = attended_row<T, D>(rows_a, count_a, rows_b, count_b, t, r0 + my_row);
  uint4 q_reg[Q_LOADS];
  uint4 r_reg;
  bool ok[PER_WARP][2][2];  // whether this lane's rows of each unit are valid, loaded with the first step
  #pragma unroll
  for (int u = 0; u < PER_WARP; ++u) {
    const int unit = warp + 8 * u;
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      #pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int r = r0 + 16 * (unit / HEAD_TILES) + 8 * n + 2 * i + b;
        ok[u][n][b] = unit < UNITS && r < count
                      && (r < count_a ? valid_a[(size_t)t * count_a + r] : valid_b[(size_t)t * count_b + (r - count_a)]);
      }
    }
  }
  float acc[PER_WARP][2][4];
  #pragma unroll
  for (int u = 0; u < PER_WARP; ++u) {
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) acc[u][n][e] = 0.0f;
    }
  }
  #pragma unroll
  for (int j = 0; j < Q_LOADS; ++j) {
    const int v = threadIdx.x + THREADS * j;
    if (v < Q_VECTORS) q_reg[j] = load8(q_t + (size_t)(v / (CHUNK / 8)) * D + 8 * (v % (CHUNK / 8)), aligned);
  }
  r_reg = load8(row ? row + my_col : row, aligned);
  for (int s = 0; s < STEPS; ++s) {
    const int buf = s & 1;  // the other buffer was last read before the previous step's barrier
    #pragma unroll
    for (int j = 0; j < Q_LOADS; ++j) {
      const int v = threadIdx.x + THREADS * j;
      if (v < Q_VECTORS) *reinterpret_cast<uint4*>(&q_s[buf][v / (CHUNK / 8)][8 * (v % (CHUNK / 8))]) = q_reg[j];
    }
    *reinterpret_cast<uint4*>(&r_s[buf][my_row][my_col]) = r_reg;
    __syncthreads();
    if (s + 1 < STEPS) {
      const int k0 = (s + 1) * CHUNK;
      #pragma unroll
      for (int j = 0; j < Q_LOADS; ++j) {
        const int v = threadIdx.x + THREADS * j;
        if (v < Q_VECTORS) q_reg[j] = load8(q_t + (size_t)(v / (CHUNK / 8)) * D + k0 + 8 * (v % (CHUNK / 8)), aligned);
      }
      r_reg = load8(row ? row + k0 + my_col : row, aligned);
    }
    #pragma unroll
    for (int u = 0; u < PER_WARP; ++u) {
      const int unit = warp + 8 * u;
      if (unit >= UNITS) break;
      const int h0 = 16 * (unit % HEAD_TILES);
      const int n0 = 16 * (unit / HEAD_TILES);
      #pragma unroll
      for (int kk = 0; kk < CHUNK; kk += 16) {
        const uint32_t a[4] = {shared_pair(&q_s[buf][h0 + g][kk + 2 * i]), shared_pair(&q_s[buf][h0 + g + 8][kk + 2 * i]),
                               shared_pair(&q_s[buf][h0 + g][kk + 2 * i + 8]), shared_pair(&q_s[buf][h0 + g + 8][kk + 2 * i + 8])};
        #pragma unroll
        for (int n = 0; n < 2; ++n) {
          const uint32_t b[2] = {shared_pair(&r_s[buf][n0 + 8 * n + g][kk + 2 * i]), shared_pair(&r_s[buf][n0 + 8 * n + g][kk + 2 * i + 8])};
          mma(acc[u][n], a, b, T());
        }
      }
    }
  }
  #pragma unroll
  for (int u = 0; u < PER_WARP; ++u) {
    const int unit = warp + 8 * u;
    if (unit >= UNITS) break;
    const int h0 = 16 * (unit % HEAD_TILES);
    const int tr0 = r0 + 16 * (unit / HEAD_TILES);  // the unit's first row
    if (tr0 >= count) break;  // the block's last tile past the rows (warp-uniform)
    float value[2][4];  // the logits of this lane's (head, row) pairs, -inf past the rows
    #pragma unroll
    for (int n = 0; n < 2; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = h0 + g + (e >= 2 ? 8 : 0);
        const int r = tr0 + 8 * n + 2 * i + (e & 1);
        value[n][e] = -__int_as_float(0x7f800000);
        if (r < count) {
          const T product = static_cast<T>(ok[u][n][e & 1] ? acc[u][n][e] : value[n][e]);
          if (ok[u][n][e & 1]) value[n][e] = __fmul_rn(static_cast<float>(product), scale);
          products[((size_t)t * H + h) * count + r] = product;
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
        float* st = stats + (((size_t)t * H + h0 + g + 8 * half) * tiles + tr0 / 16) * 2;
        st[0] = m;
        st[1] = sum;
      }
    }
  }
}

// Heads h0 .. h0 + HB - 1's max and normalizer's reciprocal from their tiles' (max, exp-sum) [tiles, 2] and their
// sinks -> head_max[h - h0], head_inverse[h - h0]. A warp takes HB / WARPS heads at once: all their tiles' values
// load together (one round trip, not two a head), then each head as MLX's softmax: a lane's tiles in order, xor
// shuffles, __expf, one reciprocal.
template <typename S, int HB, int WARPS>
__device__ void head_stats(const float* stats, int tiles, const S* sinks, int h0, float* head_max, float* head_inverse) {
  constexpr int HEADS_A_WARP = HB / WARPS;
  const int lane = threadIdx.x & 31;
  const int first = h0 + (threadIdx.x >> 5) * HEADS_A_WARP;
  float tile_max[HEADS_A_WARP][TILES_A_LANE];
  float tile_sum[HEADS_A_WARP][TILES_A_LANE];
  float sink[HEADS_A_WARP];
  #pragma unroll
  for (int hh = 0; hh < HEADS_A_WARP; ++hh) {
    const float* sh = stats + (size_t)(first + hh) * tiles * 2;
    sink[hh] = static_cast<float>(sinks[first + hh]);
    #pragma unroll
    for (int q = 0; q < TILES_A_LANE; ++q) {
      const int j = lane + 32 * q;
      tile_max[hh][q] = j < tiles ? sh[2 * j] : -__int_as_float(0x7f800000);
      tile_sum[hh][q] = j < tiles ? sh[2 * j + 1] : 0.0f;
    }
  }
  #pragma unroll
  for (int hh = 0; hh < HEADS_A_WARP; ++hh) {
    float m = sink[hh];
    #pragma unroll
    for (int q = 0; q < TILES_A_LANE; ++q) m = fmaxf(m, tile_max[hh][q]);
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    float e = 0.0f;
    #pragma unroll
    for (int q = 0; q < TILES_A_LANE; ++q) {
      if (tile_sum[hh][q] > 0.0f) e = __fadd_rn(e, __fmul_rn(tile_sum[hh][q], __expf(tile_max[hh][q] - m)));
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) e = __fadd_rn(e, __shfl_xor_sync(0xFFFFFFFFu, e, o));
    if (lane == 0) {
      head_max[first - h0 + hh] = m;
      head_inverse[first - h0 + hh] = 1.0f / __fadd_rn(e, __expf(sink[hh] - m));
    }
  }
}

// Block (64 columns, HB heads, token t), a warp a (16 heads, 32 columns) tile: the heads' softmax statistics from
// the tiles', then out[t, heads, columns] = probabilities x rows, each group's part rounded to T, the parts added
// in T. The rows in staged steps of OUT_ROWS: the next step's rows [OUT_ROWS, 64] (16 bytes a thread) and products
// [HB, OUT_ROWS] (a warp a head's consecutive ones) load while the warps multiply this step's; a step's
// probabilities are computed once, by the thread that stages them (the logit as the logits kernel scaled it, MLX's
// __expf and normalizer, rounded to T). A tile's sums run over the rows in one order.
template <typename T, typename S, int H, int HB, int D, int GROUPS>
__device__ void tile_output(const T* products, const float* stats, const T* rows_a, int count_a, const T* rows_b, int count_b,
                            const S* sinks, float scale, T* out) {
  constexpr int KR = OUT_ROWS;
  constexpr int HEAD_TILES = HB / 16;
  constexpr int WARPS = HEAD_TILES * (OUT_COLUMNS / 32);
  constexpr int THREADS_OUT = 32 * WARPS;
  constexpr int R_LOADS = KR * OUT_COLUMNS / 8 / THREADS_OUT;  // 16-byte pieces of a step's rows a thread
  constexpr int P_LOADS = HB * KR / THREADS_OUT;  // a step's products a thread
  __shared__ __align__(16) unsigned short r_s[2][KR][OUT_COLUMNS + PAD];
  __shared__ __align__(16) unsigned short p_s[2][HB][KR + PAD];
  __shared__ float head_max[HB];
  __shared__ float head_inverse[HB];
  const int t = blockIdx.y;
  const int c0 = (blockIdx.x % (D / OUT_COLUMNS)) * OUT_COLUMNS;
  const int hb0 = (blockIdx.x / (D / OUT_COLUMNS)) * HB;  // the block's first head
  const int count = count_a + count_b;
  const int tiles = (count + 15) / 16;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, i = threadIdx.x & 3;  // lane = 4 g + i (the fragments')
  const int h0 = 16 * (warp % HEAD_TILES);  // the warp's tile, in the block's heads
  const int cw = 32 * (warp / HEAD_TILES);  // and in its columns
  const bool aligned = all_aligned(rows_a, rows_b, rows_a);
  const T* lt = products + ((size_t)t * H + hb0) * count;
  head_stats<S, HB, WARPS>(stats + (size_t)t * H * tiles * 2, tiles, sinks, hb0, head_max, head_inverse);
  __syncthreads();
  T part[4][4];
  uint4 r_reg[R_LOADS];
  T l_reg[P_LOADS];
  int step = 0;  // steps over both groups: the buffers alternate across the groups' boundary too
  #pragma unroll 1
  for (int grp = 0; grp < GROUPS; ++grp) {
    const T* rows = grp == 0 ? rows_a + (size_t)t * count_a * D : rows_b + (size_t)t * count_b * D;
    const int cnt = grp == 0 ? count_a : count_b;
    const T* lg = lt + (grp == 0 ? 0 : count_a);
    float acc[4][4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    }
    #pragma unroll
    for (int j = 0; j < R_LOADS; ++j) {
      const int v = threadIdx.x + THREADS_OUT * j, k = v / 8;
      r_reg[j] = load8(k < cnt ? rows + (size_t)k * D + c0 + 8 * (v % 8) : nullptr, aligned);
    }
    #pragma unroll
    for (int j = 0; j < P_LOADS; ++j) {
      const int v = threadIdx.x + THREADS_OUT * j, k = v % KR;
      l_reg[j] = k < cnt ? lg[(size_t)(v / KR) * count + k] : static_cast<T>(0.0f);
    }
    for (int k0 = 0; k0 < cnt; k0 += KR, ++step) {
      const int buf = step & 1;  // the other buffer was last read before the previous step's barrier
      #pragma unroll
      for (int j = 0; j < R_LOADS; ++j) {
        const int v = threadIdx.x + THREADS_OUT * j;
        *reinterpret_cast<uint4*>(&r_s[buf][v / 8][8 * (v % 8)]) = r_reg[j];
      }
      #pragma unroll
      for (int j = 0; j < P_LOADS; ++j) {
        const int v = threadIdx.x + THREADS_OUT * j, h = v / KR, k = v % KR;
        const float logit = __fmul_rn(static_cast<float>(l_reg[j]), scale);
        const T p = static_cast<T>(k0 + k < cnt ? __fmul_rn(__expf(logit - head_max[h]), head_inverse[h]) : 0.0f);
        p_s[buf][h][k] = static_cast<unsigned short>(raw_bits(p));
      }
      __syncthreads();
      if (k0 + KR < cnt) {
        const int k1 = k0 + KR;
        #pragma unroll
        for (int j = 0; j < R_LOADS; ++j) {
          const int v = threadIdx.x + THREADS_OUT * j, k = k1 + v / 8;
          r_reg[j] = load8(k < cnt ? rows + (size_t)k * D + c0 + 8 * (v % 8) : nullptr, aligned);
        }
        #pragma unroll
        for (int j = 0; j < P_LOADS; ++j) {
          const int v = threadIdx.x + THREADS_OUT * j, k = k1 + v % KR;
          l_reg[j] = k < cnt ? lg[(size_t)(v / KR) * count + k] : static_cast<T>(0.0f);
        }
      }
      #pragma unroll
      for (int kk = 0; kk < KR; kk += 16) {
        const uint32_t a[4] = {shared_pair(&p_s[buf][h0 + g][kk + 2 * i]), shared_pair(&p_s[buf][h0 + g + 8][kk + 2 * i]),
                               shared_pair(&p_s[buf][h0 + g][kk + 2 * i + 8]), shared_pair(&p_s[buf][h0 + g + 8][kk + 2 * i + 8])};
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = cw + 8 * j + g;
          const uint32_t b[2] = {static_cast<uint32_t>(r_s[buf][kk + 2 * i][c]) | (static_cast<uint32_t>(r_s[buf][kk + 2 * i + 1][c]) << 16),
                                 static_cast<uint32_t>(r_s[buf][kk + 2 * i + 8][c]) | (static_cast<uint32_t>(r_s[buf][kk + 2 * i + 9][c]) << 16)};
          mma(acc[j], a, b, T());
        }
      }
    }
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const T mine = static_cast<T>(acc[j][e]);  // the group's part, rounded as the reference rounds it
        part[j][e] = grp == 0 ? mine : static_cast<T>(__fadd_rn(static_cast<float>(part[j][e]), static_cast<float>(mine)));
      }
    }
  }
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = hb0 + h0 + g + (e >= 2 ? 8 : 0);
      const int c = c0 + cw + 8 * j + 2 * i + (e & 1);
      out[((size_t)t * H + h) * D + c] = part[j][e];
    }
  }
}
"""

# The CUDA source's layout constants, from the Python ones above (one owner).
_HEADER = (f"constexpr int THREADS = {THREADS};\nconstexpr int LOGIT_ROWS = {LOGIT_ROWS};\nconstexpr int CHUNK = {COLUMNS};\n"
           f"constexpr int OUT_COLUMNS = {COLUMNS};\nconstexpr int OUT_ROWS = {OUTPUT_ROWS};\n"
           f"constexpr int TILES_A_LANE = {-(-MAX_ATTENDED // (TILE * 32))};\n") + _KERNELS  # a warp's lanes hold a head's tiles

_LOGITS_ONE = r"""
  // q [T, H, D]; rows_a [T, Ra, D], valid_a [T, Ra] -> products [T, H, Ra] T, stats [T, H, Ra / 16, 2] float32
  tile_logits<T, H, D>(q, rows_a, valid_a, rows_a_shape[1], rows_a, valid_a, 0, __int_as_float(SCALE_BITS), products, stats);
"""

_LOGITS_TWO = r"""
  // q [T, H, D]; rows_a [T, Ra, D], valid_a [T, Ra]; rows_b [T, Rb, D], valid_b [T, Rb]
  //   -> products [T, H, Ra + Rb] T, stats [T, H, (Ra + Rb) / 16, 2] float32
  tile_logits<T, H, D>(q, rows_a, valid_a, rows_a_shape[1], rows_b, valid_b, rows_b_shape[1], __int_as_float(SCALE_BITS),
                       products, stats);
"""

_OUTPUT_ONE = r"""
  // products [T, H, Ra], stats [T, H, Ra / 16, 2]; rows_a [T, Ra, D]; sinks [H] -> out [T, H, D]
  tile_output<T, S, H, HB, D, 1>(products, stats, rows_a, rows_a_shape[1], rows_a, 0, sinks, __int_as_float(SCALE_BITS), out);
"""

_OUTPUT_TWO = r"""
  // products [T, H, Ra + Rb], stats [T, H, (Ra + Rb) / 16, 2]; rows_a [T, Ra, D]; rows_b [T, Rb, D]; sinks [H] -> out [T, H, D]
  tile_output<T, S, H, HB, D, 2>(products, stats, rows_a, rows_a_shape[1], rows_b, rows_b_shape[1], sinks, __int_as_float(SCALE_BITS),
                             out);
"""

_LOGITS_INPUTS = {1: ("q", "rows_a", "valid_a"), 2: ("q", "rows_a", "valid_a", "rows_b", "valid_b")}
_OUTPUT_INPUTS = {1: ("products", "stats", "rows_a", "sinks"), 2: ("products", "stats", "rows_a", "rows_b", "sinks")}
_LOGITS_SOURCES = {1: _LOGITS_ONE, 2: _LOGITS_TWO}
_OUTPUT_SOURCES = {1: _OUTPUT_ONE, 2: _OUTPUT_TWO}


def logits_kernel_name(groups: int) -> str:
    return f"tessera_decode_attention_logits_{groups}"


def output_kernel_name(groups: int) -> str:
    return f"tessera_decode_attention_output_{groups}"


def logits_template(dtype: mx.Dtype, heads: int, dim: int, scale: float) -> list[tuple[str, object]]:
    return [("T", dtype), ("H", heads), ("D", dim), ("SCALE_BITS", float_bits(scale))]


_forced_block_heads: int | None = None


def force_block_heads(heads: int | None) -> None:
    """The output kernel's heads a block, for a probe's comparison of layouts (None: `block_heads`' choice). Every
    layout gives a token the same bits at every batch size; they differ from each other in no bit either (a
    (16 heads, 32 columns) tile's sums run in the same order whatever the block around it)."""
    if heads not in (None, 16, 32, 64):  # 128 would take 512 threads and 54 KiB of shared memory
        raise ValueError(f"{heads} heads a block: 16, 32 or 64")
    global _forced_block_heads
    _forced_block_heads = heads


def block_heads(heads: int) -> int:
    """The output kernel's heads a block: a function of the heads only, never of the batch."""
    wanted = _forced_block_heads or OUTPUT_HEADS
    return wanted if heads % wanted == 0 else TILE


def output_threads(heads: int) -> int:
    return 32 * block_heads(heads) // TILE * (COLUMNS // 32)  # a warp a (16 heads, 32 columns) tile


def output_template(dtype: mx.Dtype, sinks_dtype: mx.Dtype, heads: int, dim: int, scale: float) -> list[tuple[str, object]]:
    return [("T", dtype), ("S", sinks_dtype), ("H", heads), ("HB", block_heads(heads)), ("D", dim), ("SCALE_BITS", float_bits(scale))]


def decode_attention_kernel(q: mx.array, groups: Sequence[RowGroup], sinks: mx.array, scale: float) -> mx.array:
    """q: [T, H, d], groups: one or two (rows [T, R, d], valid [T, R]), sinks: [H] -> [T, H, d], as
    sparse_attention.mixed_attention_reference (where `is_supported`)."""
    tokens, heads, dim = q.shape
    groups = [(rows, valid) for rows, valid in groups if rows.shape[1] > 0]  # the first has rows (`is_supported`)
    count = len(groups)
    attended = sum(rows.shape[1] for rows, _ in groups)
    tiles = -(-attended // TILE)  # the softmax statistics' 16-row tiles
    logits_kernel = compiled_kernel(logits_kernel_name(count), _LOGITS_INPUTS[count], ("products", "stats"), _LOGITS_SOURCES[count],
                                    _HEADER)
    products, stats = logits_kernel(
        inputs=[q] + [a for rows, valid in groups for a in (rows, valid.astype(mx.bool_))],
        template=logits_template(q.dtype, heads, dim, scale),
        grid=(-(-attended // LOGIT_ROWS) * THREADS, tokens, 1),  # threads, as mx.fast.cuda_kernel counts them: a block per (32 rows, token)
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(tokens, heads, attended), (tokens, heads, tiles, 2)],
        output_dtypes=[q.dtype, mx.float32],
    )  # [T, H, R], [T, H, R / 16, 2]
    output_kernel = compiled_kernel(output_kernel_name(count), _OUTPUT_INPUTS[count], ("out",), _OUTPUT_SOURCES[count], _HEADER)
    (out,) = output_kernel(
        inputs=[products, stats] + [rows for rows, _ in groups] + [sinks],
        template=output_template(q.dtype, sinks.dtype, heads, dim, scale),
        grid=(dim // COLUMNS * heads // block_heads(heads) * output_threads(heads), tokens, 1),  # a block per (columns, heads, token)
        threadgroup=(output_threads(heads), 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out
