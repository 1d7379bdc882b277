"""One row per (token, expert) pair through its mxfp4 expert, `out[p] = x[p] · W[experts[p]]ᵀ`: a plain-MLX
reference (`mx.gather_qmm`) and, for MLX's CUDA backend, a gemv kernel that reads each pair's expert rows
once, with x held in registers.

Why: a decode step's MoE is the gathered layout, one row per pair (engine/model/moe.py). MLX 0.32's CUDA
GatherQMM runs its gemv (qmv) only for calls of fewer than 8 rows; from 8 rows on (a decode batch of two
or more sequences at top-6) a CuTe GEMM (qmm_sm80) whose row tiles each hold one row: on the H200, at V4
Flash's expert shapes and 96 pairs (16 sequences), ~0.38 ms a projection for ~0.43 GB, ~1.1 TB/s.

The kernel: a block per (pair, ROWS_PER_BLOCK output rows) of K / 32 threads, thread g owning the 32-element
group g of every row: its 32 x values stay in registers for all the block's rows (read once per block through
shared memory, consecutive threads reading consecutive elements: `STAGE_X`), and each row's group is
one 16-byte load (four uint32 of eight 4-bit E2M1 codes, low nibble first: MLX's mxfp4 layout). UNROLL
rows' loads are issued before their sums. Codes are decoded through a 16-entry table in shared memory (one
shared load per element), summed as code value × x in float32, the group's sum scaled by its E8M0 scale (a
power of two: exact); a warp's 32 groups are summed by shuffles, the warps' sums in shared memory, in a
fixed order. So an output depends on its own row only: the same bits whatever the batch (MLX's own switch
from qmv to qmm_sm80 at 8 rows changes a row's bits with the batch). Not the reference's bits (another
summation order): the CUDA tests compare to within the output dtype's rounding, and bit for bit on inputs
whose sums are exact in float32 (tests/test_kernels_cuda.py).

Measured on the H200 (docs/BENCHMARKS.md, "Session 11 on the H200"): a batch-16 decode step as loaded
(flash-width, 16k) 9.1 ms against 10.7 with gather_qmm on one machine, no difference on a host-bound one;
batch 1 unchanged. An earlier layout that staged x in shared memory (two shared loads per element) was
8–12 % slower than this one and was removed. Reading each thread's x group straight from global memory (lanes
64 bytes apart: as many L1 requests as the weights) left the kernel at ~1.2 TB/s at 96 pairs; reading x
coalesced first (`STAGE_X`, the default) took 13–15 % off at 96 pairs, 11 % at 48, 5 % at 16, none at 6
(docs/BENCHMARKS.md, "Session 13 on the H200"): ~1.6 TB/s, still far from the copy rate. `stage_x=False`
keeps the direct read for the probe's comparison (docs/bench/gather_qmm_rows_probe.py). Tried in session 14
and not kept, each giving this kernel's bits: codes decoded by bit moves into half2 instead of the table
(no shared load, ~10 % fewer instructions), the next rows' loads issued before this batch's sums, 16 rows
in flight, 64 rows a block — none faster at 6–96 pairs, 64 rows a block 1.6× slower (commit 6aba040 and the
next two; docs/BENCHMARKS.md, "Session 14 on the H200").

Session 29 (docs/BENCHMARKS.md, "Session 29 on the H200"): under ncu at 96 pairs the kernel runs the L1/shared
pipe at 88 % and DRAM at 40 %: the 16-entry table's one shared load per element bounds it, with the integer pipe
(a shift and a mask per element) close behind. Tried there and removed, each giving this kernel's bits: reading
each expert once for all the pairs that share it (a grouped kernel) and an L2 prefetch of a block's first rows,
neither faster (commit 88072f8); a byte table (a code byte's two values as bf16 from one shared load, 32 copies so
that lane l reads bank l: half the shared loads, 3.5 instead of 4 instructions an element), 1.2–2.1× slower at
8–16 tokens (its 32 KiB table filled per block and 5 blocks an SM instead of 9; commit 052ec31).

The kernel reads pair p's row x[p // rows_per_x]: a decode step's k pairs of a token read the token's row, without
the repeat that would copy it k times (engine/model/moe.py, `_pairs_in_order`).

Session 30: a tensor-core variant for bf16 rows (`gather_qmv_mma_kernel`; TESSERA_GATHER_QMV_MMA, on by default).
The table's shared load, the shift and mask before it and the FMA after it (four instructions an element, the first
bound to the L1 pipe) become bit moves that write two codes as a bf16 pair (code << 6 is the code's value times
2^-126, bf16's subnormal range included), one bf16x2 multiply by the group's scale times 2^126 (exact: a power of
two; two multiplies for scales above 2^1), and an mma.sync m16n8k16 per 256 weights with x as column 0 of its B
operand: by its SASS (ptxas 13, sm_90) about 2.5 instructions an element, none of them shared loads. A warp's quad
holds rows g and g + 8 of a 16-row tile, each lane one 16-byte code group of each; the warps of a block take the
row's 128-element chunks in turn, and their partial sums are added in warp order, so a row's bits still do not
depend on the batch. Not the table kernel's bits (the tensor cores sum in their own order): the CUDA tests hold it
to the reference's bits on exact inputs and every code and scale, and to the output's rounding otherwise. Measured
in session 31 on an H100, before the fix below: 7-15 % faster than the table kernel at 8 and 16 tokens' pairs, no
slower at 1 (docs/BENCHMARKS.md). The same lease's CUDA tests hung it on mixed scales: the two-multiply path was
chosen per lane, and mma.sync needs the whole warp. The path is now the warp's (`__any_sync`, one vote a code
group). Session 33 (an H100): with the fix, the kernel's CUDA tests pass (21, the mixed-scale case among them) and
so does the whole CUDA suite with the variant on (154 passed, 1 skipped). Session 35 (an H100, the kernel-alone
probe docs/bench/gather_qmv_variants_probe.py, A B B A): with the fix the variant is still 9-17 % faster at V4
Flash's expert shapes, at 6, 48 and 96 pairs, up and down, uniform and skewed routing (at 96 pairs 0.167-0.173 ms
against 0.189-0.200), so the switch is on by default (TESSERA_GATHER_QMV_MMA=0 keeps the table kernel). In a whole
decode step the gain (~5 us a call) is below a host's noise (docs/BENCHMARKS.md).

Switch: TESSERA_GATHER_QMV_KERNEL=0 keeps MLX's gather_qmm (1, the default, uses the kernel where it
applies: CUDA; mxfp4, group 32, no biases; one row per pair; K a multiple of 1024 up to 11,264 (the
shared memory `STAGE_X` needs) and an output width a multiple of ROWS_PER_BLOCK, `fits`).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import SHARED_MEMORY_LIMIT, compiled_kernel, on_cuda
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_GATHER_QMV_KERNEL"
_switch = Switch(ENV_VAR, default=True)
MMA_ENV_VAR = "TESSERA_GATHER_QMV_MMA"
_mma_switch = Switch(MMA_ENV_VAR, default=True)

ROWS_PER_BLOCK = 32  # output rows of one pair per block
UNROLL = 8  # rows whose loads are in flight together
STAGE_X = True  # x read coalesced into shared memory, then each thread's group into registers
GROUP = 32  # mxfp4: 32 elements share an E8M0 scale; one group is one 16-byte vector of codes


def kernel_enabled() -> bool:
    return _switch.enabled()


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def mma_enabled() -> bool:
    return _mma_switch.enabled()


def set_mma_enabled(enabled: bool) -> None:
    _mma_switch.set(enabled)


def gather_qmv_reference(x: mx.array, values: mx.array, scales: mx.array, experts: mx.array, rows_per_x: int = 1) -> mx.array:
    """x: [P / rows_per_x, K], pair p's row x[p // rows_per_x]; values, scales: mxfp4 experts [E, N, K] as
    `mx.quantize(..., mode="mxfp4")` packs them ([E, N, K / 8] uint32, [E, N, K / 32] uint8); experts: [P] -> [P, N]
    in x's dtype: pair p's row through expert experts[p]."""
    rows = mx.repeat(x, rows_per_x, axis=0) if rows_per_x > 1 else x
    out = mx.gather_qmm(rows[:, None, :], values, scales, None, rhs_indices=experts, transpose=True,
                        group_size=GROUP, bits=4, mode="mxfp4")  # [P, 1, N]
    return out[:, 0, :]


def shared_memory_bytes(in_features: int, stage_x: bool = STAGE_X) -> int:
    """The block's static shared memory: the code table, the warps' partial sums and, with STAGE_X, x as
    float32 in rows of 33 (a padded row per group)."""
    groups = in_features // GROUP
    return 16 * 4 + (groups // 32) * ROWS_PER_BLOCK * 4 + (groups * 33 * 4 if stage_x else 4)


def fits(in_features: int, out_features: int) -> bool:
    """A block holds K / 32 threads (one per group, in whole warps, at most 1,024) and ROWS_PER_BLOCK rows,
    and its shared memory stays within the static limit (with STAGE_X: K up to 11,264)."""
    return (in_features % 1024 == 0 and in_features // GROUP <= 1024 and out_features % ROWS_PER_BLOCK == 0
            and shared_memory_bytes(in_features) <= SHARED_MEMORY_LIMIT)


def is_supported(dtype: mx.Dtype, in_features: int, values: mx.array) -> bool:
    """Rows of `dtype` and width `in_features` through mxfp4 experts `values` (the caller checks the mode, bits
    4, group 32 and no biases)."""
    return (_switch.enabled() and on_cuda() and values.ndim == 3 and fits(in_features, values.shape[1])
            and dtype in (mx.bfloat16, mx.float16, mx.float32))


_HEADER = r"""
// E2M1 code c (sign, 2 exponent bits, 1 mantissa bit) -> 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
__device__ __forceinline__ void tessera_e2m1_table(float* lut, int c) {
  const int e = (c >> 1) & 3;
  const float mag = e == 0 ? 0.5f * (c & 1) : ldexpf(1.0f + 0.5f * (c & 1), e - 1);
  lut[c] = (c & 8) ? -mag : mag;
}

// Output row g of the block: its warps' partial sums added in warp order (a fixed order: a row's bits do not
// depend on the rows beside it).
template <int WARPS, int ROWS>
__device__ __forceinline__ float tessera_row_total(const float (*partial)[ROWS], int g) {
  float total = 0.0f;
  #pragma unroll
  for (int k = 0; k < WARPS; ++k) total += partial[k][g];
  return total;
}

// x as float32 into shared memory, group h's element i at h * 33 + i; consecutive threads read consecutive
// elements (coalesced), and each thread's later read of its own group hits 32 banks.
template <typename T, int GROUPS>
__device__ __forceinline__ void tessera_stage_row(float* xs, const T* xrow, int g) {
  #pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int i = g + j * GROUPS;
    xs[(i >> 5) * 33 + (i & 31)] = static_cast<float>(xrow[i]);
  }
}

// One pair's ROWS rows of its expert, x in registers (xv): per thread 32 fmaf in element order over the row's code
// group (decoded through the 16-entry table `lut`), scaled by the group's power of two, shuffled down, one partial
// sum per warp (`part`), which the caller adds in warp order.
template <int GROUPS, int ROWS, int UNROLL>
__device__ __forceinline__ void tessera_expert_rows(const uint4* codes, const uint8_t* srow, const float* lut,
                                                    const float (&xv)[32], float (*part)[ROWS], int warp, int lane) {
  for (int r0 = 0; r0 < ROWS; r0 += UNROLL) {
    uint4 q[UNROLL];
    int e[UNROLL];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // every load of the batch in flight before the first sum
      q[u] = codes[(size_t)(r0 + u) * GROUPS];
      e[u] = srow[(size_t)(r0 + u) * GROUPS];
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint32_t words[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
      float sum = 0.0f;
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        #pragma unroll
        for (int b = 0; b < 8; ++b) sum = fmaf(lut[(words[j] >> (4 * b)) & 0xF], xv[8 * j + b], sum);
      }
      float acc = sum * ldexpf(1.0f, e[u] - 127);
      #pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
      if (lane == 0) part[warp][r0 + u] = acc;
    }
  }
}
"""

_SOURCE = r"""
  // x [P / X_DIV, K] T; w [E, N, K / 8] uint32; scales [E, N, K / 32] uint8; experts [P] uint32 -> out [P, N] T.
  constexpr int GROUPS = K / 32;  // = threads per block: one 16-byte group of each row per thread
  constexpr int WARPS = GROUPS / 32;
  constexpr int BLOCKS_PER_PAIR = N / ROWS;
  __shared__ float lut[16];
  __shared__ float partial[WARPS][ROWS];
  __shared__ float xs[STAGE_X ? GROUPS * 33 : 1];
  const int pair = blockIdx.x / BLOCKS_PER_PAIR;
  const int row0 = (blockIdx.x % BLOCKS_PER_PAIR) * ROWS;
  const int g = threadIdx.x;
  if (threadIdx.x < 16) tessera_e2m1_table(lut, threadIdx.x);
  const size_t first = (size_t)experts[pair] * N + row0;  // the block's first weight row
  const uint4* codes = reinterpret_cast<const uint4*>(w) + first * GROUPS + g;
  const uint8_t* srow = scales + first * GROUPS + g;
  const T* xrow = x + (size_t)(pair / X_DIV) * K;  // X_DIV pairs share a row: a token's top-k
  if (STAGE_X) tessera_stage_row<T, GROUPS>(xs, xrow, g);
  __syncthreads();
  float xv[32];
  #pragma unroll
  for (int i = 0; i < 32; ++i) xv[i] = STAGE_X ? xs[g * 33 + i] : static_cast<float>(xrow[g * 32 + i]);
  tessera_expert_rows<GROUPS, ROWS, UNROLL>(codes, srow, lut, xv, partial, g >> 5, g & 31);
  __syncthreads();
  if (g < ROWS) out[(size_t)pair * N + row0 + g] = static_cast<T>(tessera_row_total<WARPS, ROWS>(partial, g));
"""


_MMA_HEADER = r"""
// Codes I and I + 4 of a word of eight E2M1 codes (low nibble first) as a bf16 pair, code I in the low half, each
// value times 2^-126: a code's two exponent bits and its mantissa bit land on bf16's two lowest exponent bits and
// its top mantissa bit (a zero exponent field is bf16's subnormal range, where 0.5 * 2^-126 falls), its sign bit on
// the sign bit. Exact for all sixteen codes.
template <int I>
__device__ __forceinline__ uint32_t tessera_e2m1_pair(uint32_t w) {
  const uint32_t magnitude = (I < 2 ? w << (6 - 4 * I) : w >> (4 * I - 6)) & 0x01C001C0u;
  return magnitude | ((w << (12 - 4 * I)) & 0x80008000u);
}

// 2^(field - 127) in both halves of a bf16 pair (field: a bf16 exponent field, 1 ... 254).
__device__ __forceinline__ uint32_t tessera_bf16x2_pow2(int field) {
  return (uint32_t)field << 7 | (uint32_t)field << 23;
}

// a * b in each half (plus -0.0, which keeps a product's sign and adds nothing): exact for a power-of-two b.
__device__ __forceinline__ uint32_t tessera_bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// d += A (16 x 16 bf16, rows: the quad's rows g and g + 8) B (16 x 8 bf16) on the tensor cores, float32 sums.
__device__ __forceinline__ void tessera_mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x's bf16 row as the mma's B operand: group h's word v (v = 0 ... 15) holds elements 8 (v / 4) + v % 4 and that + 4,
// the pair tessera_e2m1_pair<v % 4> decodes from the group's code word v / 4; groups STRIDE words apart (padded: a
// quad's four groups on distinct banks).
template <int GROUPS, int STRIDE, int THREADS>
__device__ __forceinline__ void tessera_stage_pairs(uint32_t* xs, const uint16_t* xrow) {
  for (int u = threadIdx.x; u < GROUPS * 16; u += THREADS) {
    const int h = u >> 4, v = u & 15;
    const int e = h * 32 + 8 * (v >> 2) + (v & 3);
    xs[h * STRIDE + v] = (uint32_t)xrow[e] | (uint32_t)xrow[e + 4] << 16;
  }
}

// One code group (32 codes) of each of the quad's two rows, as eight mmas: code word j's pairs 0 and 1 against x's
// words 4j, 4j + 1 (k slots 2t, 2t + 1 and 2t + 8, 2t + 9 of lane t), its pairs 2 and 3 against 4j + 2, 4j + 3.
// The codes are scaled to their true values before the mma (2^-126 * 2^(s - 127) = 2^(s - 1): one multiply where
// s <= 128, two above, BIG), so every product the tensor cores sum is exact.
template <bool BIG>
__device__ __forceinline__ void tessera_group_mma(float (&d)[4], const uint4& qa, const uint4& qb, int sa, int sb,
                                                  const uint32_t* xg) {
  const uint32_t wa[4] = {qa.x, qa.y, qa.z, qa.w}, wb[4] = {qb.x, qb.y, qb.z, qb.w};
  const uint32_t fa = tessera_bf16x2_pow2((BIG ? min(sa, 128) : sa) + 126);
  const uint32_t fb = tessera_bf16x2_pow2((BIG ? min(sb, 128) : sb) + 126);
  const uint32_t fa2 = tessera_bf16x2_pow2(max(sa, 128) - 1), fb2 = tessera_bf16x2_pow2(max(sb, 128) - 1);
  uint32_t xv[16];
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = reinterpret_cast<const uint4*>(xg)[i];
    xv[4 * i] = v.x; xv[4 * i + 1] = v.y; xv[4 * i + 2] = v.z; xv[4 * i + 3] = v.w;
  }
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a[4] = {tessera_e2m1_pair<0>(wa[j]), tessera_e2m1_pair<1>(wa[j]), tessera_e2m1_pair<2>(wa[j]),
                     tessera_e2m1_pair<3>(wa[j])};
    uint32_t b[4] = {tessera_e2m1_pair<0>(wb[j]), tessera_e2m1_pair<1>(wb[j]), tessera_e2m1_pair<2>(wb[j]),
                     tessera_e2m1_pair<3>(wb[j])};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = tessera_bf16x2_mul(a[i], fa);
      b[i] = tessera_bf16x2_mul(b[i], fb);
      if (BIG) {
        a[i] = tessera_bf16x2_mul(a[i], fa2);
        b[i] = tessera_bf16x2_mul(b[i], fb2);
      }
    }
    tessera_mma_bf16(d, a[0], b[0], a[1], b[1], xv[4 * j], xv[4 * j + 1]);
    tessera_mma_bf16(d, a[2], b[2], a[3], b[3], xv[4 * j + 2], xv[4 * j + 3]);
  }
}
"""

_MMA_SOURCE = r"""
  // x [P / X_DIV, K] bf16; w [E, N, K / 8] uint32; scales [E, N, K / 32] uint8; experts [P] uint32 -> out [P, N] bf16.
  constexpr int GROUPS = K / 32;
  constexpr int CHUNKS = GROUPS / 4;  // 128 elements: one 16-byte code group of a row per quad lane
  constexpr int TILES = ROWS / 16;  // the mma's 16 rows
  constexpr int BLOCKS_PER_PAIR = N / ROWS;
  constexpr int STRIDE = 20;
  __shared__ __align__(16) uint32_t xs[GROUPS * STRIDE];
  __shared__ float partial[WARPS][ROWS];
  const int pair = blockIdx.x / BLOCKS_PER_PAIR;
  const int row0 = (blockIdx.x % BLOCKS_PER_PAIR) * ROWS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad = lane >> 2, t = lane & 3;  // the mma's groupID (rows quad, quad + 8) and thread in group
  tessera_stage_pairs<GROUPS, STRIDE, WARPS * 32>(
      xs, reinterpret_cast<const uint16_t*>(x) + (size_t)(pair / X_DIV) * K);  // X_DIV pairs share a row
  __syncthreads();
  const size_t first = (size_t)experts[pair] * N + row0;  // the block's first weight row
  #pragma unroll
  for (int tile = 0; tile < TILES; ++tile) {
    const size_t ra = first + tile * 16 + quad, rb = ra + 8;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c0 = warp; c0 < CHUNKS; c0 += WARPS * UNROLL) {  // warp w: chunks w, w + WARPS, ... in order
      uint4 qa[UNROLL], qb[UNROLL];
      int sa[UNROLL], sb[UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {  // every load of the batch in flight before the first mma
        const int h = 4 * min(c0 + u * WARPS, CHUNKS - 1) + t;
        qa[u] = reinterpret_cast<const uint4*>(w)[ra * GROUPS + h];
        qb[u] = reinterpret_cast<const uint4*>(w)[rb * GROUPS + h];
        sa[u] = scales[ra * GROUPS + h];
        sb[u] = scales[rb * GROUPS + h];
      }
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int c = c0 + u * WARPS;
        if (c >= CHUNKS) break;
        const uint32_t* xg = xs + (4 * c + t) * STRIDE;
        // mma.sync needs the whole warp: the path is the warp's, the second multiply where any lane's scale needs it
        if (__any_sync(0xffffffffu, sa[u] > 128 || sb[u] > 128)) {
          tessera_group_mma<true>(d, qa[u], qb[u], sa[u], sb[u], xg);
        } else {
          tessera_group_mma<false>(d, qa[u], qb[u], sa[u], sb[u], xg);
        }
      }
    }
    if (t == 0) {  // column 0 of the mma's output: x's (the others repeat it)
      partial[warp][tile * 16 + quad] = d[0];
      partial[warp][tile * 16 + quad + 8] = d[2];
    }
  }
  __syncthreads();
  if (threadIdx.x < ROWS) {
    float total = 0.0f;
    #pragma unroll
    for (int k = 0; k < WARPS; ++k) total += partial[k][threadIdx.x];  // warp order: fixed
    out[(size_t)pair * N + row0 + threadIdx.x] = static_cast<T>(total);
  }
"""

MMA_ROWS = 32  # output rows of one pair per block: two mma tiles
MMA_WARPS = 4
MMA_UNROLL = 4  # code groups per lane whose loads are in flight together


def gather_qmv_mma_kernel(x: mx.array, values: mx.array, scales: mx.array, experts: mx.array, rows_per_x: int = 1,
                          rows: int = MMA_ROWS, warps: int = MMA_WARPS, unroll: int = MMA_UNROLL) -> mx.array:
    """`gather_qmv_kernel` on the tensor cores, for bf16 rows: the codes decoded to bf16 by bit moves (no table),
    scaled to their values, and summed by mma.sync with x as the B operand's column. `rows` (a multiple of 16 that
    divides N), `warps` and `unroll` set the block's shape (the probe's arms; the defaults are the engine's)."""
    pairs, k, n = experts.shape[0], x.shape[1], values.shape[1]
    assert x.dtype == mx.bfloat16 and x.shape[0] * rows_per_x == pairs, (x.dtype, x.shape, rows_per_x, pairs)
    assert rows % 16 == 0 and n % rows == 0, (rows, n)
    threads = warps * 32
    kernel = compiled_kernel("tessera_gather_qmv_mxfp4_mma", ("x", "w", "scales", "experts"), ("out",), _MMA_SOURCE,
                             _MMA_HEADER)
    (out,) = kernel(
        inputs=[x, values, scales, experts.astype(mx.uint32)],
        template=[("T", x.dtype), ("K", k), ("N", n), ("ROWS", rows), ("WARPS", warps), ("UNROLL", unroll),
                  ("X_DIV", rows_per_x)],
        grid=(pairs * (n // rows) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(pairs, n)],
        output_dtypes=[x.dtype],
    )
    return out


def gather_qmv_kernel(x: mx.array, values: mx.array, scales: mx.array, experts: mx.array, rows_per_x: int = 1,
                      stage_x: bool = STAGE_X) -> mx.array:
    """x: [P / rows_per_x, K] bf16/fp16/fp32 on a CUDA device, pair p's row x[p // rows_per_x] (a token's top-k pairs
    read its row without a repeat); values [E, N, K / 8] uint32, scales [E, N, K / 32] uint8 (mxfp4); experts: [P]
    -> [P, N] in x's dtype (shapes as `fits` says). bf16 rows take the tensor-core variant where its switch is on
    (`gather_qmv_mma_kernel`)."""
    if x.dtype == mx.bfloat16 and _mma_switch.enabled():
        return gather_qmv_mma_kernel(x, values, scales, experts, rows_per_x)
    pairs, k, n = experts.shape[0], x.shape[1], values.shape[1]
    assert x.shape[0] * rows_per_x == pairs, (x.shape, rows_per_x, pairs)
    threads = k // GROUP
    kernel = compiled_kernel("tessera_gather_qmv_mxfp4", ("x", "w", "scales", "experts"), ("out",), _SOURCE, _HEADER)
    (out,) = kernel(
        inputs=[x, values, scales, experts.astype(mx.uint32)],
        template=[("T", x.dtype), ("K", k), ("N", n), ("ROWS", ROWS_PER_BLOCK), ("UNROLL", UNROLL), ("STAGE_X", int(stage_x)),
                  ("X_DIV", rows_per_x)],
        grid=(pairs * (n // ROWS_PER_BLOCK) * threads, 1, 1),  # threads, as mx.fast.cuda_kernel counts them
        threadgroup=(threads, 1, 1),
        output_shapes=[(pairs, n)],
        output_dtypes=[x.dtype],
    )
    return out
