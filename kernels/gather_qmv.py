"""One row per (token, expert) pair through its mxfp4 expert, `out[p] = x[p] · W[experts[p]]ᵀ`: a plain-MLX
reference (`mx.gather_qmm`) and, for MLX's CUDA backend, a gemv kernel meant to read each pair's expert
rows at memory speed.

Why: a decode step's MoE is the gathered layout, one row per pair (engine/model/moe.py). MLX 0.32's CUDA
GatherQMM runs its gemv (qmv) only for calls of fewer than 8 rows; from 8 rows on (a decode batch of two
or more sequences at top-6) a CuTe GEMM (qmm_sm80) whose row tiles each hold one row. On the H200, at V4
Flash's expert shapes and 96 pairs (16 sequences), one projection took ~0.38 ms for ~0.43 GB: ~1.1 TB/s,
a quarter of the copy rate; the batch-16 MoE was ~4.6 ms of a 12–16 ms step (docs/BENCHMARKS.md,
"Session 10 on the H200"). Splitting the rows into calls of 7 (MLX's qmv) was slower still.

Two layouts of the kernel, both reading one 16-byte vector per 32-element group of a weight row (four
uint32 of eight 4-bit E2M1 codes, low nibble first: MLX's mxfp4 layout), decoding codes through a 16-entry
table in shared memory, summing code value × x in float32 and scaling the group's sum by its E8M0 scale (a
power of two: exact):

- split_k (K a multiple of 1024, the V4 Flash widths): a block per (pair, ROWS_PER_BLOCK output rows) of
  K / 32 threads, thread g owning group g of every row and that group's 32 x values in registers, so x is
  read once per block and the inner loop has one shared-memory load (the table) per element; UNROLL rows'
  loads are issued before their sums. A warp's 32 groups are summed by shuffles, the warps' sums in
  shared memory, in a fixed order.
- staged (any K a multiple of 32): the pair's x row staged in shared memory as float32 (33 floats per
  group, so the 32 lanes of a warp, each on its own group, read 32 banks), a warp per output row at a
  time, each lane summing every 32nd group; two shared-memory loads per element.

An output depends on its own row only: the same bits whatever the batch. Not the reference's bits (another
summation order): the CUDA tests compare to within the output dtype's rounding, and bit for bit on inputs
whose sums are exact in float32 (tests/test_kernels_cuda.py).

Switch: TESSERA_GATHER_QMV_KERNEL=1 uses it where supported (CUDA; mxfp4, group 32, no biases; one row
per pair; output width a multiple of ROWS_PER_BLOCK). **Off by default: written without a GPU in session
10, neither its test nor its speed has run yet** — the next GPU session runs both (docs/BENCHMARKS.md,
"For the next GPU session").
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, on_cuda
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_GATHER_QMV_KERNEL"
_switch = Switch(ENV_VAR, default=False)

WARPS = 8
ROWS_PER_WARP = 4
ROWS_PER_BLOCK = WARPS * ROWS_PER_WARP  # output rows of one pair per block
UNROLL = 8  # split-K layout: rows whose loads are in flight together
GROUP = 32  # mxfp4: 32 elements share an E8M0 scale; one group is one 16-byte vector of codes


def kernel_enabled() -> bool:
    return _switch.enabled()


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def gather_qmv_reference(x: mx.array, values: mx.array, scales: mx.array, experts: mx.array) -> mx.array:
    """x: [P, K]; values, scales: mxfp4 experts [E, N, K] as `mx.quantize(..., mode="mxfp4")` packs them
    ([E, N, K / 8] uint32, [E, N, K / 32] uint8); experts: [P] -> [P, N] in x's dtype: row p through expert
    experts[p]."""
    out = mx.gather_qmm(x[:, None, :], values, scales, None, rhs_indices=experts, transpose=True,
                        group_size=GROUP, bits=4, mode="mxfp4")  # [P, 1, N]
    return out[:, 0, :]


def is_supported(dtype: mx.Dtype, in_features: int, values: mx.array) -> bool:
    """Rows of `dtype` and width `in_features` through mxfp4 experts `values` (the caller checks the mode, bits
    4, group 32 and no biases)."""
    return (_switch.enabled() and on_cuda() and values.ndim == 3 and in_features % GROUP == 0
            and values.shape[1] % ROWS_PER_BLOCK == 0 and dtype in (mx.bfloat16, mx.float16, mx.float32))


def gather_qmv(x: mx.array, values: mx.array, scales: mx.array, experts: mx.array) -> mx.array:
    """`gather_qmv_reference`, through the kernel where it is supported."""
    if not is_supported(x.dtype, x.shape[-1], values) or x.shape[0] == 0:
        return gather_qmv_reference(x, values, scales, experts)
    return gather_qmv_kernel(x, values, scales, experts)


_LUT = r"""
  if (threadIdx.x < 16) {  // E2M1: sign, 2 exponent bits, 1 mantissa bit -> 0, 0.5, 1, 1.5, 2, 3, 4, 6
    const int c = threadIdx.x;
    const int e = (c >> 1) & 3;
    const float mag = e == 0 ? 0.5f * (c & 1) : ldexpf(1.0f + 0.5f * (c & 1), e - 1);
    lut[c] = (c & 8) ? -mag : mag;
  }
"""

# Staged: x in shared memory, a warp per output row at a time, each lane summing every 32nd group.
_SOURCE_STAGED = r"""
  // x [P, K] T; w [E, N, K / 8] uint32; scales [E, N, K / 32] uint8; experts [P] uint32 -> out [P, N] T.
  constexpr int GROUPS = K / 32;  // 16-byte vectors (groups) per weight row
  constexpr int BLOCKS_PER_PAIR = N / (WARPS * ROWS_PER_WARP);
  __shared__ float xs[GROUPS * 33];  // group g's element i at g * 33 + i: lanes on different groups, different banks
  __shared__ float lut[16];
  const int pair = blockIdx.x / BLOCKS_PER_PAIR;
  const int row0 = (blockIdx.x % BLOCKS_PER_PAIR) * (WARPS * ROWS_PER_WARP);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
""" + _LUT + r"""
  const T* xrow = x + (size_t)pair * K;
  for (int i = threadIdx.x; i < K; i += blockDim.x) xs[(i / 32) * 33 + i % 32] = static_cast<float>(xrow[i]);
  __syncthreads();
  const size_t expert = experts[pair];
  for (int r = 0; r < ROWS_PER_WARP; ++r) {
    const int n = row0 + warp * ROWS_PER_WARP + r;
    const size_t wrow = expert * N + n;
    const uint4* codes = reinterpret_cast<const uint4*>(w) + wrow * GROUPS;
    const uint8_t* srow = scales + wrow * GROUPS;
    float acc = 0.0f;
    #pragma unroll
    for (int g = lane; g < GROUPS; g += 32) {
      const uint4 q = codes[g];
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
      const float* xg = xs + g * 33;
      float sum = 0.0f;
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        #pragma unroll
        for (int b = 0; b < 8; ++b) sum = fmaf(lut[(words[j] >> (4 * b)) & 0xF], xg[8 * j + b], sum);
      }
      acc = fmaf(sum, ldexpf(1.0f, (int)srow[g] - 127), acc);
    }
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (lane == 0) out[(size_t)pair * N + n] = static_cast<T>(acc);
  }
"""

# Split K: thread g of a block owns group g of every row (K / 32 threads), its 32 x values in registers
# for all ROWS rows of the block; a warp's lanes are summed by shuffles, the warps in shared memory.
_SOURCE_SPLIT_K = r"""
  // x [P, K] T; w [E, N, K / 8] uint32; scales [E, N, K / 32] uint8; experts [P] uint32 -> out [P, N] T.
  constexpr int GROUPS = K / 32;  // = threads per block: one 16-byte group of each row per thread
  constexpr int WARPS = GROUPS / 32;
  constexpr int BLOCKS_PER_PAIR = N / ROWS;
  __shared__ float lut[16];
  __shared__ float partial[WARPS][ROWS];
  const int pair = blockIdx.x / BLOCKS_PER_PAIR;
  const int row0 = (blockIdx.x % BLOCKS_PER_PAIR) * ROWS;
  const int g = threadIdx.x;
  const int lane = g & 31;
  const int warp = g >> 5;
""" + _LUT + r"""
  float xv[32];
  const T* xg = x + (size_t)pair * K + g * 32;
  #pragma unroll
  for (int i = 0; i < 32; ++i) xv[i] = static_cast<float>(xg[i]);
  __syncthreads();
  const size_t first = (size_t)experts[pair] * N + row0;  // the block's first weight row
  const uint4* codes = reinterpret_cast<const uint4*>(w) + first * GROUPS + g;
  const uint8_t* srow = scales + first * GROUPS + g;
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
      if (lane == 0) partial[warp][r0 + u] = acc;
    }
  }
  __syncthreads();
  if (g < ROWS) {
    float total = 0.0f;
    #pragma unroll
    for (int k = 0; k < WARPS; ++k) total += partial[k][g];
    out[(size_t)pair * N + row0 + g] = static_cast<T>(total);
  }
"""


def split_k_fits(k: int) -> bool:
    """The split-K layout holds a block of K / 32 threads (one per group): K a multiple of 1024, ≤ 32,768."""
    return k % 1024 == 0 and k // 32 <= 1024


def gather_qmv_kernel(x: mx.array, values: mx.array, scales: mx.array, experts: mx.array,
                      layout: str | None = None) -> mx.array:
    """x: [P, K] bf16/fp16/fp32 on a CUDA device; values [E, N, K / 8] uint32, scales [E, N, K / 32] uint8
    (mxfp4); experts: [P] -> [P, N] in x's dtype. `layout`: "split_k" or "staged" (None: split_k where
    the width fits, `split_k_fits`)."""
    pairs, k = x.shape
    n = values.shape[1]
    layout = layout or ("split_k" if split_k_fits(k) else "staged")
    inputs = [x, values, scales, experts.astype(mx.uint32)]
    names = (("x", "w", "scales", "experts"), ("out",))
    if layout == "split_k":
        kernel = compiled_kernel("tessera_gather_qmv_mxfp4_split_k", *names, _SOURCE_SPLIT_K, "")
        template = [("T", x.dtype), ("K", k), ("N", n), ("ROWS", ROWS_PER_BLOCK), ("UNROLL", UNROLL)]
        threads = k // 32
    else:
        kernel = compiled_kernel("tessera_gather_qmv_mxfp4", *names, _SOURCE_STAGED, "")
        template = [("T", x.dtype), ("K", k), ("N", n), ("WARPS", WARPS), ("ROWS_PER_WARP", ROWS_PER_WARP)]
        threads = WARPS * 32
    (out,) = kernel(
        inputs=inputs,
        template=template,
        grid=(pairs * (n // ROWS_PER_BLOCK) * threads, 1, 1),  # threads, as mx.fast.cuda_kernel counts them
        threadgroup=(threads, 1, 1),
        output_shapes=[(pairs, n)],
        output_dtypes=[x.dtype],
    )
    return out
