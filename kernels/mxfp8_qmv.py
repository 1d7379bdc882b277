"""A decode batch's rows through an mxfp8 projection, `out[g, r] = x[g, r] · W[g]ᵀ`: a plain-MLX reference
(`mx.gather_qmm`, group g through weight g) and, for MLX's CUDA backend, a kernel that reads each weight row
once for all of the batch's rows.

Why: MLX 0.32's CUDA quantized matmul runs its gemv (qmv) below 8 rows and from 8 rows a CuTe GEMM
(qmm_sm80) that tiles the output in 128-column blocks and does not split K. At a decode batch of 16 rows the
narrow projections then run on a few thread blocks of the H200's 132 SMs: the stacked q_a+kv [1536, 4096] on
12 blocks, 99 µs for 6.3 MB; in all 2.8 ms of a batch-16 step's 9.6 ms of kernel time (ncu), against 0.42 ms
for the same projections at batch 1 (docs/BENCHMARKS.md, "Session 14 on the H200").

The kernel: a block of THREADS threads per (weight group g, WEIGHT_ROWS output columns). Thread t takes
the 4-element pieces t, t + THREADS, … of the input width: one uint32 of four E4M3 codes for each of its
weight rows (consecutive threads reading consecutive words), decoded once (bit moves into fp16, which holds
an E4M3 value times 2^-8 exactly, normal and subnormal alike; the 2^8 goes into the group's E8M0 scale, a
power of two: exact), then multiplied into every row of x (RB accumulators a weight row, x read through the
L1 cache: every block reads the same few rows). So each weight byte is read once per call whatever the batch.
The threads' sums are combined in a fixed tree: a warp's by a reduce-scatter of shuffles (lane bit 4 first,
then 3 … 0), the warps' in shared memory in warp order. An output therefore depends on its own row only: the
same bits at every batch size the kernel runs (rows past the batch's last repeat it, into accumulators
never written out). Not the reference's bits (another summation order): the CUDA tests compare to within
the output dtype's rounding, and bit for bit on inputs whose sums are exact in float32
(tests/test_kernels_cuda.py). E4M3's NaN code (0x7F) reads as 1.875 × 2^-8 × scale, not NaN: a quantizer
never writes it for finite weights.

Measured on the H200 (docs/BENCHMARKS.md, "Session 15 on the H200"): a batch-16 step's mxfp8 projections
2.79 → 1.22 ms of kernel time (ncu), the step's device time 6.2 → 5.4 ms; the serving step, bound by the
host at batch 16, 8.43 → 8.22 ms. Passed its CUDA tests there (tests/test_kernels_cuda.py).

Switch: TESSERA_MXFP8_QMV_KERNEL=0 keeps MLX's quantized matmul (1, the default, uses the kernel where it
applies: CUDA; mxfp8, group 32, no biases; MIN_ROWS … MAX_ROWS rows; K a multiple of 4 · THREADS and an
output width a multiple of WEIGHT_ROWS, `fits`; and a projection narrow enough that MLX's GEMM leaves SMs
idle, GEMM_FULL_BLOCKS).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, on_cuda
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_MXFP8_QMV_KERNEL"
_switch = Switch(ENV_VAR, default=True)

THREADS = 128  # a block: four warps splitting the input width
WEIGHT_ROWS = 4  # output columns a block computes, each weight row decoded once for all rows of x
MAX_ROWS = 16  # accumulators a thread holds: WEIGHT_ROWS × row bucket ≤ 64
GROUP = 32  # mxfp8: 32 elements share an E8M0 scale
# Where the kernel runs in the engine (op bench on the H200, docs/BENCHMARKS.md "Session 15 on the H200"):
# from MIN_ROWS rows, where MLX leaves its gemv (below 8 rows its qmv was faster than this kernel: 2 rows
# 51 against 62 µs at q_a+kv), and where MLX's GEMM runs fewer thread blocks (one per 128 output columns
# and group) than GEMM_FULL_BLOCKS (the H200's 132 SMs): there its idle SMs lose (wo_b at 16 rows: 311
# against 125 µs), while a GEMM that fills them runs on tensor cores and wins (q_b, 256 blocks: 71 against
# 144 µs; this kernel sums on the CUDA cores).
MIN_ROWS = 8
GEMM_FULL_BLOCKS = 132


def kernel_enabled() -> bool:
    return _switch.enabled()


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def row_bucket(rows: int) -> int:
    """The accumulators a thread keeps per weight row for `rows` rows: 1, 4, 8 or 16 (few kernel variants;
    a row's bits do not depend on the bucket)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be in 1..{MAX_ROWS}, got {rows}")
    return next(b for b in (1, 4, 8, 16) if rows <= b)


def fits(in_features: int, out_features: int) -> bool:
    """Every thread takes the same number of 4-element pieces, and a block's columns are whole."""
    return in_features % (4 * THREADS) == 0 and out_features % WEIGHT_ROWS == 0


def gemm_blocks(groups: int, out_features: int) -> int:
    """Thread blocks MLX's qmm_sm80 runs for a few rows: one per 128 output columns of each group."""
    return groups * -(-out_features // 128)


def is_supported(dtype: mx.Dtype, rows: int, values: mx.array, mode: str, group_size: int, has_biases: bool) -> bool:
    """Whether `rows` rows of `dtype` through the packed weight `values` ([N, K / 4] or grouped [G, N, K / 4])
    take the kernel: where it runs (`fits`) and where it beats MLX's (MIN_ROWS, GEMM_FULL_BLOCKS)."""
    # the cheap checks first: every quantized projection of every step asks (at batch 1 the first answers)
    if not (MIN_ROWS <= rows <= MAX_ROWS and mode == "mxfp8" and group_size == GROUP and not has_biases
            and values.ndim in (2, 3) and dtype in (mx.bfloat16, mx.float16, mx.float32) and _switch.enabled()
            and on_cuda()):
        return False
    groups = values.shape[0] if values.ndim == 3 else 1
    return fits(values.shape[-1] * 4, values.shape[-2]) and gemm_blocks(groups, values.shape[-2]) < GEMM_FULL_BLOCKS


def mxfp8_qmv_reference(x: mx.array, values: mx.array, scales: mx.array) -> mx.array:
    """x: [G, R, K]; values [G, N, K / 4] uint32, scales [G, N, K / 32] uint8 (`mx.quantize(..., mode="mxfp8")`
    of each group's [N, K]) -> [G, R, N] in x's dtype: group g's rows through weight g."""
    groups = mx.arange(values.shape[0], dtype=mx.uint32)
    return mx.gather_qmm(x, values, scales, None, rhs_indices=groups, transpose=True, group_size=GROUP, bits=8,
                         mode="mxfp8")


_HEADER = r"""
template <typename T>
struct alignas(4 * sizeof(T)) Quad { T v[4]; };  // four consecutive x elements, one vector load

// A warp's COUNT sums per lane, summed over the lanes: at the step across lane bit M a lane keeps the half
// of its sums that bit selects, added to its partner's same half (bit 4 first, then 3 … 0: one tree for
// every sum); once one sum is left, both partners add it (the same bits either way). Compile-time counts
// keep `acc` in registers.
template <int COUNT, int M>
__device__ __forceinline__ void warp_reduce_scatter(float* acc, int lane, int& base) {
  if constexpr (M > 0) {
    if constexpr (COUNT >= 2) {
      constexpr int H = COUNT / 2;
      const bool upper = (lane & M) != 0;
      #pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = upper ? acc[i] : acc[i + H];
        const float keep = upper ? acc[i + H] : acc[i];
        acc[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, M);
      }
      if (upper) base += H;
      warp_reduce_scatter<H, M / 2>(acc, lane, base);
    } else {
      acc[0] += __shfl_xor_sync(0xFFFFFFFFu, acc[0], M);
      warp_reduce_scatter<1, M / 2>(acc, lane, base);
    }
  }
}
"""

_SOURCE = r"""
  // x [G, R, K] T; w [G, N, K / 4] uint32 (four E4M3 codes, low byte first); scales [G, N, K / 32] uint8
  // (E8M0) -> out [G, R, N] T. RB >= R accumulators per weight row.
  constexpr int PIECES = K / 4;
  constexpr int GROUPS = K / 32;
  constexpr int WARPS = THREADS / 32;
  constexpr int V = WR * RB;  // this thread's partial sums: weight row j, x row r at j * RB + r
  constexpr int HELD = V >= 32 ? V / 32 : 1;  // sums a lane holds after the warp's reduce-scatter
  __shared__ float partial[WARPS][V];
  const int R = x_shape[1];
  const int g = blockIdx.x / (N / WR);
  const int col0 = (blockIdx.x % (N / WR)) * WR;
  const int t = threadIdx.x;
  const int lane = t & 31;
  const int warp = t >> 5;
  const uint32_t* wrows = w + ((size_t)g * N + col0) * PIECES;
  const uint8_t* srows = scales + ((size_t)g * N + col0) * GROUPS;
  const T* xg = x + (size_t)g * R * K;
  float acc[V];
  #pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.0f;
  for (int p = t; p < PIECES; p += THREADS) {
    float wv[WR][4];
    #pragma unroll
    for (int j = 0; j < WR; ++j) {
      const uint32_t q = wrows[(size_t)j * PIECES + p];
      // E4M3 code c as fp16 bits (c & 0x7F) << 7 | (c & 0x80) << 8 is the E4M3 value times 2^-8, exactly.
      const uint32_t c01 = __byte_perm(q, 0, 0x4140);  // codes 0 and 1 in the low bytes of two 16-bit halves
      const uint32_t c23 = __byte_perm(q, 0, 0x4342);
      const uint32_t h01 = ((c01 & 0x007F007Fu) << 7) | ((c01 & 0x00800080u) << 8);
      const uint32_t h23 = ((c23 & 0x007F007Fu) << 7) | ((c23 & 0x00800080u) << 8);
      const float2 f01 = __half22float2(*reinterpret_cast<const __half2*>(&h01));
      const float2 f23 = __half22float2(*reinterpret_cast<const __half2*>(&h23));
      const float s = ldexpf(1.0f, (int)srows[(size_t)j * GROUPS + (p >> 3)] - 127 + 8);  // E8M0 and the 2^8
      wv[j][0] = f01.x * s;
      wv[j][1] = f01.y * s;
      wv[j][2] = f23.x * s;
      wv[j][3] = f23.y * s;
    }
    #pragma unroll
    for (int r = 0; r < RB; ++r) {
      const Quad<T> xq = *reinterpret_cast<const Quad<T>*>(xg + (size_t)min(r, R - 1) * K + 4 * p);
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float xv = static_cast<float>(xq.v[i]);
        #pragma unroll
        for (int j = 0; j < WR; ++j) acc[j * RB + r] = fmaf(wv[j][i], xv, acc[j * RB + r]);
      }
    }
  }
  int base = 0;  // the first of this lane's HELD sums after the warp's reduce-scatter
  warp_reduce_scatter<V, 16>(acc, lane, base);
  if (V >= 32 || (lane & (32 / V - 1)) == 0) {  // lanes that all-reduced hold copies: one writes
    #pragma unroll
    for (int i = 0; i < HELD; ++i) partial[warp][base + i] = acc[i];
  }
  __syncthreads();
  if (t < V) {
    const int j = t / RB;
    const int r = t % RB;
    float total = 0.0f;
    #pragma unroll
    for (int k = 0; k < WARPS; ++k) total += partial[k][t];
    if (r < R) out[((size_t)g * R + r) * N + col0 + j] = static_cast<T>(total);
  }
"""


def mxfp8_qmv_kernel(x: mx.array, values: mx.array, scales: mx.array) -> mx.array:
    """x: [G, R, K] bf16/fp16/fp32 on a CUDA device, R in 1..MAX_ROWS; values [G, N, K / 4] uint32, scales
    [G, N, K / 32] uint8 (mxfp8), or [N, …] for G = 1 (no view node) -> [G, R, N] in x's dtype (shapes as
    `fits` says)."""
    groups, rows, k = x.shape
    n = values.shape[-2]
    kernel = compiled_kernel("tessera_mxfp8_qmv", ("x", "w", "scales"), ("out",), _SOURCE, _HEADER)
    (out,) = kernel(
        inputs=[x, values, scales],
        template=[("T", x.dtype), ("K", k), ("N", n), ("WR", WEIGHT_ROWS), ("RB", row_bucket(rows)), ("THREADS", THREADS)],
        grid=(groups * (n // WEIGHT_ROWS) * THREADS, 1, 1),  # threads, as mx.fast.cuda_kernel counts them
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(groups, rows, n)],
        output_dtypes=[x.dtype],
    )
    return out
