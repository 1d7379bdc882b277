"""RMS norms of bf16 or fp16 rows with float32 statistics (engine/model/norms.py): a plain-MLX reference and, for
MLX's CUDA backend, one kernel.

`out = T(x · rsqrt(mean(x²) + eps) · w)`, x and w in float32, T the rows' dtype; unweighted: `T(x · rsqrt(…))`.

Why a kernel: in MLX the reference is three launches — the cast of the rows (and the weight) to float32, MLX's
norm, the cast back — and a decode step's host encodes ~6 µs a launch (docs/BENCHMARKS.md, "Session 18"): with
~6 norms a layer (q_a's, kv's, the heads' q, the compressors', attention's, the FFN's), ~50 of a flash-width
step's ~410 launches at one token are those casts. Here a norm is one launch: a warp a row, its 16-byte pieces
(8 elements) in registers, each lane's squares summed in order, then the warp's by xor shuffles (16 … 1): one
order whatever the rows, so a row's result is the same bits at every batch size. MLX's formula otherwise:
`rsqrt(sum / D + eps)`, then `w · (x · normalizer)` in float32 (backend/cuda/rms_norm.cu). Not the reference's
bits (MLX sums in another order), within float32 rounding of the statistics: the CUDA tests hold the kernel to a
float64 evaluation and to the reference within one unit of the rows' dtype (tests/test_kernels_cuda.py).

Where it runs: bf16 and fp16 rows (the casts it removes; float32 rows take MLX's norm, one launch already) of
any count, a width a multiple of 8 up to MAX_WIDTH, on CUDA with compilation on. A row's bits do not depend on
how many rows a call has, so a prefill chunk and a decode batch norm a row alike.

Switch: TESSERA_RMS_NORM_KERNEL=1, the default since session 37, uses the kernel where `is_supported`; 0 keeps the
reference. Sessions 25 and 26 (H100s) saw no step faster with it, and it stayed off. Session 37 (an H100): its
kernel tests and the model-level CUDA tests with it on pass (49 passed, 1 skipped), and in one process, A B B A,
the 64k batch-1 step was no slower (median of four rounds 2.82 against 2.82 ms) and the 16k batch-16 step faster in
both pairs (6.19 and 5.35 against 6.86 and 5.52 ms): docs/BENCHMARKS.md, "Session 37". It takes the attention's
norms (q_a's, kv's, the heads' q, the indexer's) from three nodes to one each. The probes' arms compiled_rms_norm and
serving_overlap_rms_norm set it on, serving_overlap_no_rms_norm off.
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, float_bits, on_cuda
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_RMS_NORM_KERNEL"
_switch = Switch(ENV_VAR, default=True)

ROWS_A_BLOCK = 4  # warps a block, a row each
PIECE = 8  # elements a 16-byte load
MAX_WIDTH = 4096  # a lane holds width / 256 pieces in registers (16, 138 registers, at V4's hidden 4096)
DTYPES = (mx.bfloat16, mx.float16)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def rms_norm_reference(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x: [..., D], weight: [D] -> [..., D] in x's dtype; statistics in float32."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), eps).astype(x.dtype)


def unweighted_rms_norm_reference(x: mx.array, eps: float) -> mx.array:
    """x: [..., D] -> x · rsqrt(mean(x²) + eps) in x's dtype. `mx.fast.rms_norm` without a weight: one primitive on a
    GPU instead of a square, a sum, an element count and the fused rest (the same bits as that per-op form on the
    CPU, tests/test_compiled.py)."""
    return mx.fast.rms_norm(x.astype(mx.float32), None, eps).astype(x.dtype)


def is_supported(x: mx.array) -> bool:
    width = x.shape[-1] if x.ndim else 0
    return (_switch.enabled() and compile_enabled() and on_cuda() and x.dtype in DTYPES and x.size > 0
            and 0 < width <= MAX_WIDTH and width % PIECE == 0)


_HEADER = r"""
// 8 consecutive elements of a row as one 16-byte register set; `aligned`: the buffer starts on 16 bytes (MLX's
// allocations do; a view's offset need not), else 8 element loads.
template <typename T>
__device__ __forceinline__ uint4 load_piece(const T* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint4*>(p);
  uint4 v;
  unsigned short* h = reinterpret_cast<unsigned short*>(&v);
  #pragma unroll
  for (int k = 0; k < 8; ++k) h[k] = *reinterpret_cast<const unsigned short*>(p + k);
  return v;
}

template <typename T>
__device__ __forceinline__ float element(const uint4& v, int k) { return static_cast<float>(reinterpret_cast<const T*>(&v)[k]); }

// Row r of rows [R, D] normed by a warp -> out[r]: lane l holds pieces l, l + 32, ... (8 elements each).
template <typename T, typename W, int D, bool WEIGHTED>
__device__ void norm_row(const T* rows, const W* weight, T* out, int count, float eps) {
  constexpr int PIECES = D / 8;
  constexpr int PER_LANE = (PIECES + 31) / 32;
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (r >= count) return;  // a whole warp: its shuffles below are the warp's alone
  const bool aligned = ((reinterpret_cast<size_t>(rows) | reinterpret_cast<size_t>(out)) & 15) == 0;
  const T* x = rows + (size_t)r * D;
  uint4 v[PER_LANE];
  float squares = 0.0f;
  #pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int p = lane + 32 * j;
    if (p < PIECES) v[j] = load_piece(x + 8 * p, aligned);
  }
  #pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    if (lane + 32 * j < PIECES) {
      #pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float e = element<T>(v[j], k);
        squares = __fadd_rn(squares, __fmul_rn(e, e));
      }
    }
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) squares = __fadd_rn(squares, __shfl_xor_sync(0xFFFFFFFFu, squares, o));
  const float normalizer = rsqrtf(__fadd_rn(__fdiv_rn(squares, (float)D), eps));
  #pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int p = lane + 32 * j;
    if (p >= PIECES) continue;
    uint4 o;
    T* y = reinterpret_cast<T*>(&o);
    #pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float xn = __fmul_rn(element<T>(v[j], k), normalizer);
      y[k] = static_cast<T>(WEIGHTED ? __fmul_rn(static_cast<float>(weight[8 * p + k]), xn) : xn);
    }
    T* dst = out + (size_t)r * D + 8 * p;
    if (aligned) {
      *reinterpret_cast<uint4*>(dst) = o;
    } else {
      #pragma unroll
      for (int k = 0; k < 8; ++k) dst[k] = y[k];
    }
  }
}
"""

_WEIGHTED = r"""
  // rows [R, D] T, weight [D] W -> out [R, D] T
  norm_row<T, W, D, true>(rows, weight, out, rows_shape[0], __int_as_float(EPS_BITS));
"""

_UNWEIGHTED = r"""
  // rows [R, D] T -> out [R, D] T
  norm_row<T, T, D, false>(rows, rows, out, rows_shape[0], __int_as_float(EPS_BITS));
"""


def kernel_name(weighted: bool) -> str:
    return f"tessera_rms_norm_{'weighted' if weighted else 'unweighted'}"


def kernel_inputs(weighted: bool) -> tuple[str, ...]:
    return ("rows", "weight") if weighted else ("rows",)


def kernel_source(weighted: bool) -> str:
    return _WEIGHTED if weighted else _UNWEIGHTED


def kernel_template(dtype: mx.Dtype, weight_dtype: mx.Dtype | None, width: int, eps: float) -> list[tuple[str, object]]:
    """`eps` travels as its float32 bit pattern (a template takes integers only): the kernel adds exactly the
    float32 the reference adds."""
    weight = [] if weight_dtype is None else [("W", weight_dtype)]
    return [("T", dtype), *weight, ("D", width), ("EPS_BITS", float_bits(eps))]


def rms_norm_kernel(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """x: [..., D] bf16 or fp16 on a CUDA device (`is_supported`), weight: [D] (any float dtype) or None ->
    [..., D] in x's dtype, as the reference."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)  # [R, D]
    weighted = weight is not None
    kernel = compiled_kernel(kernel_name(weighted), kernel_inputs(weighted), ("out",), kernel_source(weighted), _HEADER)
    (out,) = kernel(
        inputs=[rows, weight] if weighted else [rows],
        template=kernel_template(x.dtype, weight.dtype if weighted else None, width, eps),
        grid=(-(-rows.shape[0] // ROWS_A_BLOCK) * 32 * ROWS_A_BLOCK, 1, 1),  # threads: a warp a row
        threadgroup=(32 * ROWS_A_BLOCK, 1, 1),
        output_shapes=[rows.shape],
        output_dtypes=[x.dtype],
    )
    return out.reshape(x.shape)
