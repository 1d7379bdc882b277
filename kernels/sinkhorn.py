"""The hyper-connections' Sinkhorn projection (engine/model/hyper.py): a plain-MLX reference and, for
MLX's CUDA backend, one kernel for all iterations.

What the engine takes from here is the layer's mixing matrix as `expand` reads it (`mixing_reference`,
`mixing_kernel`): the Sinkhorn projection of the comb mixes' softmax plus eps, rounded to the streams' dtype
and transposed (mix_t[k, j] = comb[j, k]). The kernel does the three steps around the iterations too (the eps
add before, the cast and the transposed write after), which in MLX were two more kernels and a view a collapse
(docs/BENCHMARKS.md, "Session 35"): the same round-to-nearest add and cast, so the same bits.

The reference is 2 reductions and 2 fused divisions per iteration: ~80 graph nodes (kernel launches)
per collapse, 20 iterations, 2 collapses per layer — most of a decode step's graph (docs/BENCHMARKS.md,
"Issue 14: decode overhead"). The kernel runs one thread per token with its hc×hc matrix in registers:
one launch per collapse. It sums in index order and uses round-to-nearest adds and divisions
(`__fadd_rn`, `__fdiv_rn`: never contracted or approximated), the order of `sinkhorn_ordered`, so the
two give the same bits (tests/test_kernels_cuda.py); a token's result depends only on its own row.

A thread per token is latency-bound: a decode step has 1 to 16 tokens, so one thread runs 20 iterations of
dependent divisions alone (~28.5 µs a launch on the H200, 8 launches in a flash-width step: docs/BENCHMARKS.md
"Session 17"). The warp layout (`_WARP_SOURCE`) gives each of a token's hc×hc entries a lane of its own: a lane
reads its row's (then its column's) entries from the other lanes (`__shfl_sync`) and adds them in the same
index order, then divides its own entry — the same operations on the same values, so the same bits, with
hc×hc divisions at a time instead of one. Tokens per warp: 32 // (hc·hc) (2 for V4's hc = 4); hc·hc > 32
keeps a thread per token. On the H200 (ncu, docs/BENCHMARKS.md "Session 18"): 5.2 µs a launch against 28.5 µs,
the same bits as the thread per token (its CUDA test). The step's device time did not move (1.61–1.68 against
1.58–1.65 ms at batch 1): the collapse's Sinkhorn result is first needed after the layer's block, so the
device ran the slow kernel beside the block's kernels and hid it.

Switches: TESSERA_SINKHORN_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernel
where it is supported: CUDA, float32, compilation on — kernels/shapeless.py). TESSERA_SINKHORN_WARP=0 takes
the thread per token (1, the default, the warp layout).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, float_bits, on_cuda
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_SINKHORN_KERNEL"
_switch = Switch(ENV_VAR)
_warp_switch = Switch("TESSERA_SINKHORN_WARP", default=True)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def set_warp_enabled(enabled: bool) -> None:
    _warp_switch.set(enabled)


def warp_enabled() -> bool:
    return _warp_switch.enabled()


def sinkhorn_reference(comb: mx.array, iters: int, eps: float) -> mx.array:
    """comb: [T, hc, hc] -> doubly stochastic: alternate column and row normalization, columns first
    (as the reference model does)."""
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def sinkhorn_ordered(comb: mx.array, iters: int, eps: float) -> mx.array:
    """`sinkhorn_reference` with every sum written out in index order ((c0 + c1) + c2) + …: the order
    the CUDA kernel uses (a device reduction may associate differently). On the CPU the two give the
    same bits (tests/test_kernels.py)."""
    hc = comb.shape[-1]

    def ordered_sum(parts: list[mx.array]) -> mx.array:
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total

    def columns(c: mx.array) -> mx.array:
        return c / (ordered_sum([c[:, i : i + 1, :] for i in range(hc)]) + eps)

    def rows(c: mx.array) -> mx.array:
        return c / (ordered_sum([c[:, :, j : j + 1] for j in range(hc)]) + eps)

    comb = columns(comb)
    for _ in range(iters - 1):
        comb = columns(rows(comb))
    return comb


def mixing_reference(probs: mx.array, iters: int, eps: float, dtype: mx.Dtype) -> mx.array:
    """probs: [T, hc, hc] float32, the softmax of a collapse's comb mixes -> mix_t [T, hc, hc] in `dtype`:
    the Sinkhorn projection of probs + eps, rounded to `dtype` and transposed (mix_t[t, k, j] = comb[t, j, k]),
    so that expand's product reads it as it is."""
    return sinkhorn_reference(probs + eps, iters, eps).astype(dtype).transpose(0, 2, 1)


def mixing_ordered(probs: mx.array, iters: int, eps: float, dtype: mx.Dtype) -> mx.array:
    """`mixing_reference` with `sinkhorn_ordered`'s sums: the kernel's bits."""
    return sinkhorn_ordered(probs + eps, iters, eps).astype(dtype).transpose(0, 2, 1)


OUT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def is_supported(probs: mx.array) -> bool:
    return _switch.enabled() and on_cuda() and probs.dtype == mx.float32 and probs.ndim == 3 and probs.shape[1] == probs.shape[2]


_SOURCE = r"""
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= probs_shape[0]) return;
  const float e = __int_as_float(EPS_BITS);
  const int iters = ITERS;
  float c[HC][HC];
  for (int i = 0; i < HC; ++i)
    for (int j = 0; j < HC; ++j) c[i][j] = __fadd_rn(probs[(size_t)t * HC * HC + i * HC + j], e);
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {  // rows (every iteration after the first starts with them)
      for (int i = 0; i < HC; ++i) {
        float s = c[i][0];
        for (int j = 1; j < HC; ++j) s = __fadd_rn(s, c[i][j]);
        s = __fadd_rn(s, e);
        for (int j = 0; j < HC; ++j) c[i][j] = __fdiv_rn(c[i][j], s);
      }
    }
    for (int j = 0; j < HC; ++j) {  // columns
      float s = c[0][j];
      for (int i = 1; i < HC; ++i) s = __fadd_rn(s, c[i][j]);
      s = __fadd_rn(s, e);
      for (int i = 0; i < HC; ++i) c[i][j] = __fdiv_rn(c[i][j], s);
    }
  }
  for (int i = 0; i < HC; ++i)  // transposed: entry (i, j) to [j][i], rounded to T as MLX's astype rounds
    for (int j = 0; j < HC; ++j) out[(size_t)t * HC * HC + j * HC + i] = static_cast<T>(c[i][j]);
"""

# One Sinkhorn projection of a token's hc×hc matrix on hc·hc lanes of a warp: lane base + i·HC + j holds entry
# (i, j); a row's sum is read from lanes (i, 0 … hc-1) and a column's from (0 … hc-1, j), added in index order as
# `_SOURCE` adds them. Every lane of the warp must call it (each shuffle is the whole warp's). Also the collapse
# kernel's (kernels/hc_collapse.py).
LANE_HEADER = r"""
template <int HC, int ITERS>
__device__ __forceinline__ float sinkhorn_lane(float v, int base, int i, int j, float eps) {
  constexpr unsigned FULL = 0xffffffffu;
  for (int it = 0; it < ITERS; ++it) {
    if (it > 0) {  // rows (every iteration after the first starts with them)
      float s = __shfl_sync(FULL, v, base + i * HC);
      for (int k = 1; k < HC; ++k) s = __fadd_rn(s, __shfl_sync(FULL, v, base + i * HC + k));
      s = __fadd_rn(s, eps);
      v = __fdiv_rn(v, s);
    }
    float s = __shfl_sync(FULL, v, base + j);  // columns
    for (int k = 1; k < HC; ++k) s = __fadd_rn(s, __shfl_sync(FULL, v, base + k * HC + j));
    s = __fadd_rn(s, eps);
    v = __fdiv_rn(v, s);
  }
  return v;
}
"""

# A token's hc×hc entries on as many lanes, TOKENS_PER_WARP tokens a warp (lanes past them idle, and every
# lane of a warp takes part in each shuffle), projected by `sinkhorn_lane`.
_WARP_SOURCE = r"""
  constexpr int GROUP = HC * HC;
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int num_tokens = probs_shape[0];
  if (warp * TOKENS_PER_WARP >= num_tokens) return;  // the whole warp idle: leaves together
  const int slot = lane / GROUP;
  const int t = warp * TOKENS_PER_WARP + slot;
  const bool active = slot < TOKENS_PER_WARP && t < num_tokens;
  const int base = (slot < TOKENS_PER_WARP ? slot : 0) * GROUP;  // idle lanes read a live group, harmlessly
  const int i = (lane % GROUP) / HC;
  const int j = (lane % GROUP) % HC;
  const float eps = __int_as_float(EPS_BITS);
  float v = active ? __fadd_rn(probs[(size_t)t * GROUP + i * HC + j], eps) : 1.0f;
  v = sinkhorn_lane<HC, ITERS>(v, base, i, j, eps);
  if (active) out[(size_t)t * GROUP + j * HC + i] = static_cast<T>(v);  // transposed, rounded to T
"""

THREADS = 128


def kernel_template(hc: int, iters: int, eps: float, dtype: mx.Dtype = mx.float32) -> list[tuple[str, int | mx.Dtype]]:
    """The kernel's compile-time constants. `eps` travels as its float32 bit pattern (a template takes
    integers and types only), so the kernel adds exactly the float32 the reference adds; no per-call input
    arrays. T: the output's dtype (the streams')."""
    return [("HC", hc), ("ITERS", iters), ("EPS_BITS", float_bits(eps)), ("T", dtype)]


def tokens_per_warp(hc: int) -> int:
    """Tokens a warp takes in the warp layout (a lane per matrix entry); 0: hc×hc entries exceed a warp."""
    return 32 // (hc * hc)


def mixing_kernel(probs: mx.array, iters: int, eps: float, dtype: mx.Dtype) -> mx.array:
    """probs: [T, hc, hc] float32 on a CUDA device -> `mixing_ordered`'s result, one launch (the warp layout
    where a token's matrix fits a warp and TESSERA_SINKHORN_WARP is on, else a thread per token)."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"the mixing kernel writes {OUT_DTYPES}, not {dtype}")
    rows, hc = probs.shape[0], probs.shape[-1]
    if rows == 0:
        return probs.astype(dtype)
    per_warp = tokens_per_warp(hc)
    if _warp_switch.enabled() and per_warp:
        kernel = compiled_kernel("tessera_sinkhorn_warp", ("probs",), ("out",), _WARP_SOURCE, LANE_HEADER)
        template = [*kernel_template(hc, iters, eps, dtype), ("TOKENS_PER_WARP", per_warp)]
        threads = -(-rows // per_warp) * 32
    else:
        kernel = compiled_kernel("tessera_sinkhorn", ("probs",), ("out",), _SOURCE, "")
        template, threads = kernel_template(hc, iters, eps, dtype), rows
    (out,) = kernel(
        inputs=[probs],
        template=template,
        grid=((threads + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[probs.shape],
        output_dtypes=[dtype],
    )
    return out
