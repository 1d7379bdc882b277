"""The hyper-connections' expand (engine/model/hyper.py), alone and with the MoE's sums in front of it: plain-MLX
references and, for MLX's CUDA backend, one kernel each.

`expand` writes a block's output back into a token's hc streams: new[k] = post[k]·out + Σ_j comb[j, k]·streams[j]
(post: the collapse's [hc, 1] float32 weights; mix_t[k, j] = comb[j, k], in the streams' dtype). After the MoE, the
block's output is itself two sums: the routed pairs' rows weighted by the router and summed over the k slots in
float32 (kernels/moe_padded.py `weighted_sum`), rounded, plus the shared expert's row (`moe_output`).

Why a kernel: in MLX the attention half's expand is three nodes at one token (the block output's new axis, the
[hc, hc] × [hc, D] product, the fused scale and add), and the FFN half's, with the MoE's sums, nine (the pairs'
reshape, the weights' new axis, the weighted product, its sum over the slots and a squeeze, the add of the shared
expert, then the expand's three): 12 nodes a layer, 48 of a flash-width batch-1 step's 332, each a host cost on
MLX's CUDA backend and most a launch. Here each is one launch: 40 nodes fewer a step.

The kernel: a block per (token, 2 × THREADS columns), a thread per column (two, THREADS apart, so that each warp's
loads are contiguous). A column's value of the block output is made as the reference makes it (the pairs' products
summed in slot order, rounded to the streams' dtype, the shared row added and rounded), then each of the hc new
streams as the reference rounds it: post cast to the streams' dtype, its product with the output rounded, the mixed
sum Σ_j (float32 products, in j order) rounded, the two added and rounded. A column depends on its own token only:
the same bits at every batch size. Not the reference's bits in every case (MLX sums the slots and the [hc, hc]
product in its own order), within the rounding of the streams' dtype: the CUDA tests hold it there
(tests/test_kernels_cuda.py), and to the reference bit for bit on inputs whose sums are exact.

Where it runs: CUDA decode batches (up to kernels/hc_mix.MAX_ROWS tokens, as the collapse), compilation on, hc ≤ 8,
and for the pairs MIN_SLOTS to MAX_SLOTS slots a token (kernels/moe_padded.py). Elsewhere, the CPU included, the
references: the same ops as before, the same bits.

Measured (docs/BENCHMARKS.md, "Session 37"): on an H100 the kernels' CUDA tests pass, and in one process every 64k
batch-1 round without them was 0.25-0.34 ms slower than every round with them (2.87-2.90 against 2.56-2.62 ms).

Switch: TESSERA_HC_EXPAND_KERNEL=0 keeps the references on CUDA too (1, the default, uses the kernels where they
are supported).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels import hc_mix
from tessera.kernels.cuda import compiled_kernel, on_cuda
from tessera.kernels.moe_padded import MAX_SLOTS, MIN_SLOTS, moe_output, weighted_sum
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_HC_EXPAND_KERNEL"
_switch = Switch(ENV_VAR, default=True)

THREADS = 256
COLUMNS_PER_THREAD = 2
MAX_HC = 8
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def expand_reference(block_out: mx.array, streams: mx.array, post: mx.array, mix_t: mx.array) -> mx.array:
    """block_out [T, D], streams [T, hc, D], post [T, hc, 1] float32, mix_t [T, hc, hc] in the streams' dtype
    -> the new streams [T, hc, D]: new[k] = post[k]·out + Σ_j mix_t[k, j]·streams[j]."""
    mixed = mix_t @ streams  # [T, hc, D]
    return post.astype(streams.dtype) * block_out[:, None, :] + mixed


def pairs_output(rows: mx.array, weights: mx.array, shared: mx.array) -> mx.array:
    """rows [T·k, D] (pair (t, j) at row t·k + j), weights [T, k] float32, shared [T, D] -> [T, D] in the shared
    rows' dtype: the MoE's output from its routed pairs and shared expert (kernels/moe_padded.py's definitions)."""
    num_tokens, k = weights.shape
    return moe_output(weighted_sum(rows.reshape(num_tokens, k, -1), weights), shared, shared)


def expand_pairs_reference(rows: mx.array, weights: mx.array, shared: mx.array, streams: mx.array, post: mx.array,
                           mix_t: mx.array) -> mx.array:
    """`expand_reference` of the MoE's output made from its pairs (`pairs_output`) -> the new streams [T, hc, D]."""
    return expand_reference(pairs_output(rows, weights, shared), streams, post, mix_t)


def is_supported(streams: mx.array) -> bool:
    """Whether the kernels take these streams' expand: shapes, dtype and switches only."""
    rows, hc = streams.shape[0], streams.shape[1]
    return (_switch.enabled() and compile_enabled() and on_cuda() and 0 < rows <= hc_mix.MAX_ROWS and hc <= MAX_HC
            and streams.dtype in DTYPES)


def pairs_are_supported(rows: mx.array, weights: mx.array, shared: mx.array, streams: mx.array) -> bool:
    """`is_supported`, and the MoE's parts in the streams' dtype with MIN_SLOTS to MAX_SLOTS float32 weights a token
    (the slots' sum MLX runs as the kernel repeats it, kernels/moe_padded.py)."""
    return (is_supported(streams) and rows.dtype == shared.dtype == streams.dtype and weights.dtype == mx.float32
            and MIN_SLOTS <= weights.shape[1] <= MAX_SLOTS and rows.shape[0] == weights.size)


def block_out_is_supported(block_out: mx.array, streams: mx.array) -> bool:
    """`is_supported`, and the block output in the streams' dtype (another would promote the reference's sums)."""
    return is_supported(streams) and block_out.dtype == streams.dtype


_HEADER = r"""
// A column's new streams: new[k] = T(T(T(post[k]) * out) + T(sum_j mix_t[k][j] * s[j])), the reference's roundings.
// s: the token's streams [HC, D] at column d; out: the block output's column, already rounded to T.
template <typename T, int HC>
__device__ __forceinline__ void expand_column(T* dst, const T* s, const float* post, const T* mix, float out, int d,
                                              int D) {
  float x[HC];
  #pragma unroll
  for (int j = 0; j < HC; ++j) x[j] = static_cast<float>(s[(size_t)j * D + d]);
  #pragma unroll
  for (int k = 0; k < HC; ++k) {
    float mixed = __fmul_rn(static_cast<float>(mix[k * HC]), x[0]);
    #pragma unroll
    for (int j = 1; j < HC; ++j) mixed = __fadd_rn(mixed, __fmul_rn(static_cast<float>(mix[k * HC + j]), x[j]));
    const float scaled = static_cast<float>(static_cast<T>(
        __fmul_rn(static_cast<float>(static_cast<T>(post[k])), out)));
    dst[(size_t)k * D + d] = static_cast<T>(__fadd_rn(scaled, static_cast<float>(static_cast<T>(mixed))));
  }
}
"""

# The block's columns: a block per (token, COLUMNS columns), grid x = tokens · column blocks.
_PROLOGUE = r"""
  constexpr int COLUMNS = THREADS * PER_THREAD;
  const int D = streams_shape[2];
  const int column_blocks = (D + COLUMNS - 1) / COLUMNS;
  const int t = blockIdx.x / column_blocks;
  const int first = (blockIdx.x % column_blocks) * COLUMNS + threadIdx.x;
  const T* s = streams + (size_t)t * HC * D;
  const float* p = post + (size_t)t * HC;
  const T* mix = mix_t + (size_t)t * HC * HC;
  T* dst = out + (size_t)t * HC * D;
"""

_SOURCE = _PROLOGUE + r"""
  // block_out [R, D] T, streams [R, HC, D] T, post [R, HC, 1] float32, mix_t [R, HC, HC] T -> out [R, HC, D] T
  #pragma unroll
  for (int c = 0; c < PER_THREAD; ++c) {
    const int d = first + c * THREADS;
    if (d < D) expand_column<T, HC>(dst, s, p, mix, static_cast<float>(block_out[(size_t)t * D + d]), d, D);
  }
"""

_PAIRS_SOURCE = _PROLOGUE + r"""
  // rows [R·K, D] T, weights [R, K] float32, shared [R, D] T, streams, post, mix_t as above -> out [R, HC, D] T
  const T* pair_rows = rows + (size_t)t * K * D;
  const float* w = weights + (size_t)t * K;
  #pragma unroll
  for (int c = 0; c < PER_THREAD; ++c) {
    const int d = first + c * THREADS;
    if (d >= D) continue;
    float routed = 0.0f;  // the slots in order onto 0, as MLX's sum over them (kernels/moe_padded.py)
    #pragma unroll
    for (int j = 0; j < K; ++j) routed = __fadd_rn(routed, __fmul_rn(static_cast<float>(pair_rows[(size_t)j * D + d]), w[j]));
    const float block = static_cast<float>(static_cast<T>(
        __fadd_rn(static_cast<float>(static_cast<T>(routed)), static_cast<float>(shared[(size_t)t * D + d]))));
    expand_column<T, HC>(dst, s, p, mix, block, d, D);
  }
"""

KERNEL_NAME = "tessera_hc_expand"
PAIRS_KERNEL_NAME = "tessera_hc_expand_pairs"
INPUTS = ("block_out", "streams", "post", "mix_t")
PAIRS_INPUTS = ("rows", "weights", "shared", "streams", "post", "mix_t")


def kernel_template(dtype: mx.Dtype, hc: int, slots: int | None = None) -> list[tuple[str, int | mx.Dtype]]:
    slot = [] if slots is None else [("K", slots)]
    return [("T", dtype), ("HC", hc), ("THREADS", THREADS), ("PER_THREAD", COLUMNS_PER_THREAD), *slot]


def _launch(name: str, inputs: tuple[str, ...], source: str, arrays: list[mx.array], streams: mx.array,
            slots: int | None) -> mx.array:
    rows, hc, width = streams.shape
    column_blocks = -(-width // (THREADS * COLUMNS_PER_THREAD))
    kernel = compiled_kernel(name, inputs, ("out",), source, _HEADER)
    (out,) = kernel(
        inputs=arrays,
        template=kernel_template(streams.dtype, hc, slots),
        grid=(rows * column_blocks * THREADS, 1, 1),  # threads, as mx.fast.cuda_kernel counts them
        threadgroup=(THREADS, 1, 1),
        output_shapes=[streams.shape],
        output_dtypes=[streams.dtype],
    )
    return out


def expand_kernel(block_out: mx.array, streams: mx.array, post: mx.array, mix_t: mx.array) -> mx.array:
    """`expand_reference` in one launch, on a CUDA device (`block_out_is_supported`)."""
    return _launch(KERNEL_NAME, INPUTS, _SOURCE, [block_out, streams, *_mixes(post, mix_t, streams)], streams, None)


def expand_pairs_kernel(rows: mx.array, weights: mx.array, shared: mx.array, streams: mx.array, post: mx.array,
                        mix_t: mx.array) -> mx.array:
    """`expand_pairs_reference` in one launch, on a CUDA device (`pairs_are_supported`)."""
    arrays = [rows, weights, shared, streams, *_mixes(post, mix_t, streams)]
    return _launch(PAIRS_KERNEL_NAME, PAIRS_INPUTS, _PAIRS_SOURCE, arrays, streams, weights.shape[1])


def _mixes(post: mx.array, mix_t: mx.array, streams: mx.array) -> tuple[mx.array, mx.array]:
    """post and mix_t in the dtypes the kernels read them as (float32, the streams'): what the collapse makes them
    already, so no node is added; a caller's other dtype is converted, never read as the wrong type."""
    return post.astype(mx.float32), mix_t.astype(streams.dtype)
