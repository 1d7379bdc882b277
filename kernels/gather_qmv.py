"""One row per (token, expert) pair through its mxfp4 expert, `out[p] = x[p] · W[experts[p]]ᵀ`: a plain-MLX
reference (`mx.gather_qmm`) and, for MLX's CUDA backend, a gemv kernel meant to read each pair's expert
rows at memory speed.

Why: a decode step's MoE is the gathered layout, one row per pair (engine/model/moe.py). MLX 0.32's CUDA
GatherQMM runs its gemv (qmv) only for calls of fewer than 8 rows; from 8 rows on (a decode batch of two
or more sequences at top-6) a CuTe GEMM (qmm_sm80) whose row tiles each hold one row. On the H200, at V4
Flash's expert shapes and 96 pairs (16 sequences), one projection took ~0.38 ms for ~0.43 GB: ~1.1 TB/s,
a quarter of the copy rate; the batch-16 MoE was ~4.6 ms of a 12–16 ms step (docs/BENCHMARKS.md,
"Session 10 on the H200"). Splitting the rows into calls of 7 (MLX's qmv) was slower still.

The kernel: a block per (pair, ROWS_PER_BLOCK output rows); the pair's x row staged in shared memory as
float32, padded to 33 floats per 32-element group so that the 32 lanes of a warp (each on its own group)
read 32 different banks; a warp per output row at a time; one 16-byte load is one 32-element group of the
weight row (four uint32 of eight 4-bit E2M1 codes, low nibble first, MLX's mxfp4 layout); the group's
code values × x are summed in float32, the sum scaled by the group's E8M0 scale (a power of two: exact),
and the lanes' partial sums added by shuffles in a fixed order. An output depends on its own row only: the
same bits whatever the batch. Not the reference's bits (another summation order): the CUDA test compares
to within the output dtype's rounding (tests/test_kernels_cuda.py).

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


_SOURCE = r"""
  // x [P, K] T; w [E, N, K / 8] uint32; scales [E, N, K / 32] uint8; experts [P] uint32 -> out [P, N] T.
  constexpr int GROUPS = K / 32;  // 16-byte vectors (groups) per weight row
  constexpr int BLOCKS_PER_PAIR = N / (WARPS * ROWS_PER_WARP);
  __shared__ float xs[GROUPS * 33];  // group g's element i at g * 33 + i: lanes on different groups, different banks
  __shared__ float lut[16];
  const int pair = blockIdx.x / BLOCKS_PER_PAIR;
  const int row0 = (blockIdx.x % BLOCKS_PER_PAIR) * (WARPS * ROWS_PER_WARP);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x < 16) {  // E2M1: sign, 2 exponent bits, 1 mantissa bit -> 0, 0.5, 1, 1.5, 2, 3, 4, 6
    const int c = threadIdx.x;
    const int e = (c >> 1) & 3;
    const float mag = e == 0 ? 0.5f * (c & 1) : ldexpf(1.0f + 0.5f * (c & 1), e - 1);
    lut[c] = (c & 8) ? -mag : mag;
  }
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


def gather_qmv_kernel(x: mx.array, values: mx.array, scales: mx.array, experts: mx.array) -> mx.array:
    """x: [P, K] bf16/fp16/fp32 on a CUDA device; values [E, N, K / 8] uint32, scales [E, N, K / 32] uint8
    (mxfp4); experts: [P] -> [P, N] in x's dtype."""
    pairs, k = x.shape
    n = values.shape[1]
    kernel = compiled_kernel("tessera_gather_qmv_mxfp4", ("x", "w", "scales", "experts"), ("out",), _SOURCE, "")
    (out,) = kernel(
        inputs=[x, values, scales, experts.astype(mx.uint32)],
        template=[("T", x.dtype), ("K", k), ("N", n), ("WARPS", WARPS), ("ROWS_PER_WARP", ROWS_PER_WARP)],
        grid=(pairs * (n // ROWS_PER_BLOCK) * WARPS * 32, 1, 1),  # threads, as mx.fast.cuda_kernel counts them
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(pairs, n)],
        output_dtypes=[x.dtype],
    )
    return out
