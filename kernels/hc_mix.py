"""The hyper-connections' mixing logits (engine/model/hyper.py): a plain-MLX reference and, for MLX's CUDA
backend, one kernel for a decode batch's rows.

`logits[t, m] = (rms(x[t]) · fn[m]) · scale[m] + base[m]`, x the token's hc streams flattened (hc·D wide),
fn the layer's [(2 + hc)·hc, hc·D] float32 mixing weights, rms the unweighted RMS norm in float32.

Why a kernel: in MLX the reference is four launches (the cast to float32, the norm, the product, the
fused scale and bias), and at one row the product is MLX's `gemv_single`: 8 rows of fn a block, so 3
blocks for V4's 24 mixes, each warp walking 16,384 inputs alone: ~31 µs a launch on the H200, 9 a
flash-width step, ~2.7 ms a token for V4 Flash's 43 layers (docs/BENCHMARKS.md, "Session 14", "Session 18").
The kernel is one launch: a block of THREADS threads per (token, mix), each block computing its token's
sum of squares and its mix's dot product, 4 consecutive inputs a thread per pass (vector loads).

Its sums are the threads' own in input order, then a warp's by xor shuffles (16, 8, 4, 2, 1), then the
warps' in warp order: fixed, so a token's logits depend on its own row only: the same bits at every batch
size (MLX's path does not promise that: gemv at one row, a cuBLAS GEMM at more). Not the reference's bits
(another summation order; the normed input is rounded to float32 before its product, as the reference
rounds it): the CUDA tests compare to within float32 rounding of a float64 result, and bit for bit across
batch sizes (tests/test_kernels_cuda.py).

Where it runs: decode batches, up to MAX_ROWS tokens. Each block reads its mix's fn row (64 KiB at V4
Flash's widths) whatever the batch, so a prefill chunk would read fn thousands of times; MLX's GEMM wins
there.

Switch: TESSERA_HC_MIX_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernel where it is
supported: CUDA, compilation on — kernels/shapeless.py —, up to MAX_ROWS tokens, a width a multiple of 4).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, float_bits, on_cuda
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_HC_MIX_KERNEL"
_switch = Switch(ENV_VAR, default=True)

THREADS = 256  # a block: eight warps splitting the token's hc·D inputs
MAX_ROWS = 64  # tokens a call: a decode batch; beyond, MLX's GEMM (fn read once, not once per token)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def mix_logits_reference(flat: mx.array, fn_t32: mx.array, scale: mx.array, base32: mx.array, norm_eps: float) -> mx.array:
    """flat: [T, hc·D], fn_t32: [hc·D, mixes] float32 (fn transposed), scale: [mixes] or [1], base32: [mixes]
    -> [T, mixes, 1] float32: normed streams through the mixing weights, scaled, biased."""
    normed = mx.fast.rms_norm(flat.astype(mx.float32), None, norm_eps)  # [T, hc·D] float32
    return ((normed @ fn_t32) * scale + base32)[..., None]


def is_supported(flat: mx.array) -> bool:
    rows, width = flat.shape
    return (_switch.enabled() and compile_enabled() and on_cuda() and 0 < rows <= MAX_ROWS and width % 4 == 0
            and flat.dtype in (mx.bfloat16, mx.float16, mx.float32))


HEADER = r"""  // also kernels/hc_collapse.py's (block_sum)
template <typename T>
struct alignas(4 * sizeof(T)) Quad { T v[4]; };  // four consecutive inputs, one vector load

// The block's sum of one value a thread, in a fixed order: a warp's by xor shuffles, then the warps' in warp
// order, read by every thread from shared memory (the same bits in each).
template <int WARPS>
__device__ __forceinline__ float block_sum(float v, float* partial) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = partial[0];
  #pragma unroll
  for (int k = 1; k < WARPS; ++k) total = __fadd_rn(total, partial[k]);
  __syncthreads();  // every thread has read partial before a second call writes it
  return total;
}
"""

_SOURCE = r"""
  // flat [R, K] T; fn [M, K] float32; scale [M] or [1], base [M] float32 -> out [R, M, 1] float32.
  constexpr int WARPS = THREADS / 32;
  __shared__ float partial[WARPS];
  const int m = blockIdx.x;
  const int r = blockIdx.y;
  const int K = flat_shape[1];
  const int M = fn_shape[0];
  const T* x = flat + (size_t)r * K;
  const float* w = fn + (size_t)m * K;
  float squares = 0.0f;
  for (int k = 4 * threadIdx.x; k < K; k += 4 * THREADS) {
    const Quad<T> q = *reinterpret_cast<const Quad<T>*>(x + k);
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float v = static_cast<float>(q.v[i]);
      squares = fmaf(v, v, squares);
    }
  }
  const float eps = __int_as_float(EPS_BITS);
  const float inv_rms = rsqrtf(__fadd_rn(__fdiv_rn(block_sum<WARPS>(squares, partial), (float)K), eps));
  float acc = 0.0f;
  for (int k = 4 * threadIdx.x; k < K; k += 4 * THREADS) {
    const Quad<T> q = *reinterpret_cast<const Quad<T>*>(x + k);
    const float4 f = *reinterpret_cast<const float4*>(w + k);
    acc = fmaf(__fmul_rn(static_cast<float>(q.v[0]), inv_rms), f.x, acc);  // the normed input rounded first,
    acc = fmaf(__fmul_rn(static_cast<float>(q.v[1]), inv_rms), f.y, acc);  // as the reference's float32 norm is
    acc = fmaf(__fmul_rn(static_cast<float>(q.v[2]), inv_rms), f.z, acc);
    acc = fmaf(__fmul_rn(static_cast<float>(q.v[3]), inv_rms), f.w, acc);
  }
  const float dot = block_sum<WARPS>(acc, partial);
  if (threadIdx.x == 0) {
    const float s = scale[scale_shape[0] == 1 ? 0 : m];
    out[(size_t)r * M + m] = __fadd_rn(__fmul_rn(dot, s), base[m]);
  }
"""


def kernel_template(dtype: mx.Dtype, norm_eps: float) -> list[tuple[str, object]]:
    """The kernel's compile-time constants; `norm_eps` travels as its float32 bit pattern (a template takes
    integers only), so the kernel adds exactly the float32 the reference adds."""
    return [("T", dtype), ("THREADS", THREADS), ("EPS_BITS", float_bits(norm_eps))]


def mix_logits_kernel(flat: mx.array, fn32: mx.array, scale: mx.array, base32: mx.array, norm_eps: float) -> mx.array:
    """flat: [T, hc·D] on a CUDA device (`is_supported`), fn32: [mixes, hc·D] float32 (fn untransposed),
    scale: [mixes] or [1] float32, base32: [mixes] float32 -> [T, mixes, 1] float32, as the reference."""
    rows = flat.shape[0]
    mixes = fn32.shape[0]
    kernel = compiled_kernel("tessera_hc_mix", ("flat", "fn", "scale", "base"), ("out",), _SOURCE, HEADER)
    (out,) = kernel(
        inputs=[flat, fn32, scale, base32],
        template=kernel_template(flat.dtype, norm_eps),
        grid=(mixes * THREADS, rows, 1),  # threads, as mx.fast.cuda_kernel counts them: a block per (mix, token)
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, mixes, 1)],
        output_dtypes=[mx.float32],
    )
    return out
