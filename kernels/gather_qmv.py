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

ROWS_PER_BLOCK = 32  # output rows of one pair per block
UNROLL = 8  # rows whose loads are in flight together
STAGE_X = True  # x read coalesced into shared memory, then each thread's group into registers
GROUP = 32  # mxfp4: 32 elements share an E8M0 scale; one group is one 16-byte vector of codes


def kernel_enabled() -> bool:
    return _switch.enabled()


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


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


def gather_qmv_kernel(x: mx.array, values: mx.array, scales: mx.array, experts: mx.array, rows_per_x: int = 1,
                      stage_x: bool = STAGE_X) -> mx.array:
    """x: [P / rows_per_x, K] bf16/fp16/fp32 on a CUDA device, pair p's row x[p // rows_per_x] (a token's top-k pairs
    read its row without a repeat); values [E, N, K / 8] uint32, scales [E, N, K / 32] uint8 (mxfp4); experts: [P]
    -> [P, N] in x's dtype (shapes as `fits` says)."""
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
