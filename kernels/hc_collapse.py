"""The hyper-connections' collapse after the mix logits (engine/model/hyper.py): a plain-MLX reference and, for
MLX's CUDA backend, one kernel.

From a token's mix logits ([(2 + hc)·hc]: pre, post, comb; kernels/hc_mix.py) and its hc streams, a collapse makes
- post = 2·sigmoid(post logits), [hc, 1] float32, the weights of the block's output in `expand`;
- mix_t, the comb's softmax projected by Sinkhorn (kernels/sinkhorn.py), rounded to the streams' dtype and
  transposed, as `expand` reads it;
- the block's input: the streams weighted by pre = sigmoid(pre logits) + eps, summed, rounded to the streams'
  dtype, then RMS-normed with the block's norm weight (statistics in float32, kernels/rms_norm_cuda.py's formula).

Why a kernel: in MLX that is ten launches a collapse at one token (the logits' split, the coefficients, the
weighted sum, a squeeze and two casts, the norm, a reshape, the softmax, the Sinkhorn kernel), two collapses a
layer and the head's, each node a host cost on MLX's CUDA backend and a launch on the device. With this kernel a
flash-width batch-1 step builds 332 nodes instead of 413, and on an H100 every one of three 64k decode pairs (a
process each) ran faster with it, 2.75–3.96 against 3.35–5.92 ms a step (docs/BENCHMARKS.md, "Session 36").
Here it is one launch: a block per token. Every thread
computes the token's pre weights (hc sigmoids), the block sums the weighted streams' squares over its columns,
then writes the normed row (the weighted sum made again, the same operations, so the same bits); warp 0 also
takes the post weights and the comb: a lane per comb entry, the row's softmax by shuffles in index order, then
`sinkhorn_lane` (kernels/sinkhorn.py), the warp layout's arithmetic.

Its sums are in fixed orders (a thread's columns in order, a warp's by xor shuffles, the warps' in warp order),
so a token's outputs depend on its own row only: the same bits at every batch size. Not the reference's bits
(MLX sums and exponentiates in its own order): the CUDA tests hold it to the reference within the rounding of
the streams' dtype, and bit for bit across batch sizes (tests/test_kernels_cuda.py).

The head's collapse (pre weights only, then the output norm) is the same kernel without warp 0's part
(`head_kernel`, `head_reference`).

Where it runs: where the mix kernel runs (decode batches, up to kernels/hc_mix.MAX_ROWS tokens; CUDA;
compilation on), with hc·hc ≤ 32 (one warp holds the comb; V4: hc = 4).

Switch: TESSERA_HC_COLLAPSE_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernel where it is
supported).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels import hc_mix
from tessera.kernels.cuda import compiled_kernel, float_bits, on_cuda
from tessera.kernels.rms_norm_cuda import rms_norm_reference
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.sinkhorn import LANE_HEADER, mixing_reference
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_HC_COLLAPSE_KERNEL"
_switch = Switch(ENV_VAR, default=True)

THREADS = 256  # a block a token: eight warps over the token's columns
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def coefficients(pre_logits: mx.array, post_logits: mx.array, comb_logits: mx.array, hc_eps: float):
    """[T, hc, 1], [T, hc, 1], [T, hc, hc] -> pre, post [T, hc, 1], probs [T, hc, hc] (the comb's softmax; its
    eps is added with the Sinkhorn projection, kernels/sinkhorn.py `mixing_reference`)."""
    pre = mx.sigmoid(pre_logits) + hc_eps
    post = 2 * mx.sigmoid(post_logits)
    return pre, post, mx.softmax(comb_logits, axis=-1, precise=True)


def weighted_sum(pre: mx.array, streams: mx.array) -> mx.array:
    """pre [T, hc, 1], streams [T, hc, D] -> [T, D] in the streams' dtype: the pre-weighted sum of the streams."""
    return (pre * streams).sum(axis=1).astype(streams.dtype)


def head_weighted_sum(mixes: mx.array, streams: mx.array, hc_eps: float) -> mx.array:
    """The head's collapse: mixes [T, hc, 1] float32 (pre only), streams [T, hc, D] -> [T, D] in the streams' dtype,
    the streams weighted by sigmoid(mixes) + eps and summed."""
    return weighted_sum(mx.sigmoid(mixes) + hc_eps, streams)


def collapse_reference(logits: mx.array, streams: mx.array, norm_weight: mx.array, iters: int, hc_eps: float,
                       norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """logits [T, (2 + hc)·hc, 1] float32, streams [T, hc, D], norm_weight [D] -> post [T, hc, 1] float32,
    mix_t [T, hc, hc] and the normed block input [T, D], both in the streams' dtype (the module's docstring)."""
    num_tokens, hc, _ = streams.shape
    pre_logits, post_logits, comb_logits = mx.split(logits, [hc, 2 * hc], axis=1)
    pre, post, probs = coefficients(pre_logits, post_logits, comb_logits.reshape(num_tokens, hc, hc), hc_eps)
    mix_t = mixing_reference(probs, iters, hc_eps, streams.dtype)
    return post, mix_t, rms_norm_reference(weighted_sum(pre, streams), norm_weight, norm_eps)


def is_supported(streams: mx.array) -> bool:
    """Whether the kernels take these streams' collapses (a layer's and the head's): shapes, dtype and switches only."""
    rows, hc = streams.shape[0], streams.shape[1]
    return (_switch.enabled() and hc_mix.kernel_enabled() and compile_enabled() and on_cuda()
            and 0 < rows <= hc_mix.MAX_ROWS and hc * hc <= 32 and streams.dtype in DTYPES)


_HEADER = hc_mix.HEADER + LANE_HEADER + r"""
// sigmoid as 1 / (1 + e^-|x|), mirrored for x < 0: e^-|x| never overflows.
__device__ __forceinline__ float mlx_sigmoid(float x) {
  const float y = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-fabsf(x))));
  return x < 0.0f ? __fsub_rn(1.0f, y) : y;
}

// Column d of a token's pre-weighted stream sum, rounded to T as the reference's cast rounds it, then read back as
// float32 (the norm's input). s: the token's streams [HC, D].
template <typename T, int HC>
__device__ __forceinline__ float collapsed_at(const T* s, const float* pre, int d, int D) {
  float acc = __fmul_rn(pre[0], static_cast<float>(s[d]));
  #pragma unroll
  for (int k = 1; k < HC; ++k) acc = __fadd_rn(acc, __fmul_rn(pre[k], static_cast<float>(s[(size_t)k * D + d])));
  return static_cast<float>(static_cast<T>(acc));
}
"""

# The block's input: the pre weights (the logits' first HC), the weighted sum's squares, the normed row. The logits'
# row is logits_shape[1] wide: (2 + HC)·HC for a layer's collapse, HC for the head's (pre only).
_NORMED_SOURCE = r"""
  // logits [R, M, 1] float32 (pre first), streams [R, HC, D] T, weight [D] W -> normed [R, D] T. A block a token.
  constexpr int WARPS = THREADS / 32;
  __shared__ float partial[WARPS];
  const int r = blockIdx.x;
  const int D = streams_shape[2];
  const float* lg = logits + (size_t)r * logits_shape[1];
  const T* s = streams + (size_t)r * HC * D;
  const float hc_eps = __int_as_float(HC_EPS_BITS);
  float pre[HC];
  #pragma unroll
  for (int k = 0; k < HC; ++k) pre[k] = __fadd_rn(mlx_sigmoid(lg[k]), hc_eps);
  float squares = 0.0f;
  for (int d = threadIdx.x; d < D; d += THREADS) {
    const float x = collapsed_at<T, HC>(s, pre, d, D);
    squares = __fadd_rn(squares, __fmul_rn(x, x));
  }
  const float total = block_sum<WARPS>(squares, partial);
  const float normalizer = rsqrtf(__fadd_rn(__fdiv_rn(total, (float)D), __int_as_float(NORM_EPS_BITS)));
  T* row = normed + (size_t)r * D;
  for (int d = threadIdx.x; d < D; d += THREADS) {
    const float x = collapsed_at<T, HC>(s, pre, d, D);
    row[d] = static_cast<T>(__fmul_rn(static_cast<float>(weight[d]), __fmul_rn(x, normalizer)));
  }
"""

# A layer's collapse also makes post and mix_t: warp 0, a lane per comb entry (all 32 lanes take part in each
# shuffle), -> post [R, HC, 1] float32, mix_t [R, HC, HC] T.
_MIXES_SOURCE = r"""
  if (threadIdx.x >= 32) return;
  constexpr int GROUP = HC * HC;
  constexpr unsigned FULL = 0xffffffffu;
  const int lane = threadIdx.x;
  if (lane < HC) post[(size_t)r * HC + lane] = __fmul_rn(2.0f, mlx_sigmoid(lg[HC + lane]));
  const int e = lane % GROUP;  // lanes past GROUP shadow a live entry, write nothing
  const int i = e / HC;
  const int j = e % HC;
  const float x = lg[2 * HC + e];
  float top = __shfl_sync(FULL, x, i * HC);  // row i's softmax, its sums in index order
  for (int k = 1; k < HC; ++k) top = fmaxf(top, __shfl_sync(FULL, x, i * HC + k));
  const float ex = expf(__fsub_rn(x, top));
  float sum = __shfl_sync(FULL, ex, i * HC);
  for (int k = 1; k < HC; ++k) sum = __fadd_rn(sum, __shfl_sync(FULL, ex, i * HC + k));
  float v = __fadd_rn(__fdiv_rn(ex, sum), hc_eps);
  v = sinkhorn_lane<HC, ITERS>(v, 0, i, j, hc_eps);
  if (lane < GROUP) mix_t[(size_t)r * GROUP + j * HC + i] = static_cast<T>(v);  // transposed, rounded to T
"""

_SOURCE = _NORMED_SOURCE + _MIXES_SOURCE
_HEAD_SOURCE = _NORMED_SOURCE

KERNEL_NAME = "tessera_hc_collapse"
HEAD_KERNEL_NAME = "tessera_hc_collapse_head"
INPUTS = ("logits", "streams", "weight")
OUTPUTS = ("post", "mix_t", "normed")


def kernel_template(dtype: mx.Dtype, weight_dtype: mx.Dtype, hc: int, iters: int, hc_eps: float,
                    norm_eps: float) -> list[tuple[str, int | mx.Dtype]]:
    """The kernel's compile-time constants; the eps values travel as their float32 bit patterns (a template takes
    integers and types only), so the kernel adds exactly the float32s the reference adds."""
    return [("T", dtype), ("W", weight_dtype), ("HC", hc), ("ITERS", iters), ("THREADS", THREADS),
            ("HC_EPS_BITS", float_bits(hc_eps)), ("NORM_EPS_BITS", float_bits(norm_eps))]


def collapse_kernel(logits: mx.array, streams: mx.array, norm_weight: mx.array, iters: int, hc_eps: float,
                    norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """`collapse_reference`'s outputs in one launch, on a CUDA device (`is_supported`); logits: the mix kernel's
    [T, (2 + hc)·hc, 1] float32 (kernels/hc_mix.py)."""
    rows, hc, width = streams.shape
    kernel = compiled_kernel(KERNEL_NAME, INPUTS, OUTPUTS, _SOURCE, _HEADER)
    post, mix_t, normed = kernel(
        inputs=[logits, streams, norm_weight],
        template=kernel_template(streams.dtype, norm_weight.dtype, hc, iters, hc_eps, norm_eps),
        grid=(rows * THREADS, 1, 1),  # threads, as mx.fast.cuda_kernel counts them: a block a token
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, hc, 1), (rows, hc, hc), (rows, width)],
        output_dtypes=[mx.float32, streams.dtype, streams.dtype],
    )
    return post, mix_t, normed


def head_reference(logits: mx.array, streams: mx.array, norm_weight: mx.array, hc_eps: float, norm_eps: float) -> mx.array:
    """The head's collapse: logits [T, hc, 1] float32 (pre only), streams [T, hc, D], norm_weight [D] -> the normed
    input of the vocabulary projection [T, D] in the streams' dtype."""
    return rms_norm_reference(head_weighted_sum(logits, streams, hc_eps), norm_weight, norm_eps)


def head_kernel(logits: mx.array, streams: mx.array, norm_weight: mx.array, hc_eps: float, norm_eps: float) -> mx.array:
    """`head_reference`'s result in one launch, on a CUDA device (`is_supported`); logits: the head's mix logits
    [T, hc, 1] float32."""
    rows, hc, width = streams.shape
    kernel = compiled_kernel(HEAD_KERNEL_NAME, INPUTS, ("normed",), _HEAD_SOURCE, _HEADER)
    (normed,) = kernel(
        inputs=[logits, streams, norm_weight],
        template=kernel_template(streams.dtype, norm_weight.dtype, hc, 0, hc_eps, norm_eps),
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, width)],
        output_dtypes=[streams.dtype],
    )
    return normed
