"""The hyper-connections' Sinkhorn projection (engine/model/hyper.py): a plain-MLX reference and, for
MLX's CUDA backend, one kernel for all iterations.

The reference is 2 reductions and 2 fused divisions per iteration: ~80 graph nodes (kernel launches)
per collapse, 20 iterations, 2 collapses per layer — most of a decode step's graph (docs/BENCHMARKS.md,
"Issue 14: decode overhead"). The kernel runs one thread per token with its hc×hc matrix in registers:
one launch per collapse. It sums in index order and uses round-to-nearest adds and divisions
(`__fadd_rn`, `__fdiv_rn`: never contracted or approximated), the order of `sinkhorn_ordered`, so the
two give the same bits (tests/test_kernels_cuda.py); a token's result depends only on its own row.

Switch: TESSERA_SINKHORN_KERNEL=0 keeps the reference on CUDA too (1, the default, uses the kernel
where it is supported: CUDA, float32, compilation on — kernels/shapeless.py).
"""

from __future__ import annotations

import struct

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, on_cuda
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_SINKHORN_KERNEL"
_switch = Switch(ENV_VAR)


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


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


def is_supported(comb: mx.array) -> bool:
    return _switch.enabled() and on_cuda() and comb.dtype == mx.float32 and comb.ndim == 3 and comb.shape[1] == comb.shape[2]


_SOURCE = r"""
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= comb_shape[0]) return;
  const float e = __int_as_float(EPS_BITS);
  const int iters = ITERS;
  float c[HC][HC];
  for (int i = 0; i < HC; ++i)
    for (int j = 0; j < HC; ++j) c[i][j] = comb[(size_t)t * HC * HC + i * HC + j];
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
  for (int i = 0; i < HC; ++i)
    for (int j = 0; j < HC; ++j) out[(size_t)t * HC * HC + i * HC + j] = c[i][j];
"""

THREADS = 128


def kernel_template(hc: int, iters: int, eps: float) -> list[tuple[str, int]]:
    """The kernel's compile-time constants. `eps` travels as its float32 bit pattern (a template takes
    integers only), so the kernel adds exactly the float32 the reference adds; no per-call input arrays."""
    (eps_bits,) = struct.unpack("<i", struct.pack("<f", eps))
    return [("HC", hc), ("ITERS", iters), ("EPS_BITS", eps_bits)]


def sinkhorn_kernel(comb: mx.array, iters: int, eps: float) -> mx.array:
    """comb: [T, hc, hc] float32 on a CUDA device -> the same as `sinkhorn_ordered`, one launch."""
    rows, hc = comb.shape[0], comb.shape[-1]
    if rows == 0:
        return comb
    kernel = compiled_kernel("tessera_sinkhorn", ("comb",), ("out",), _SOURCE, "")
    (out,) = kernel(
        inputs=[comb],
        template=kernel_template(hc, iters, eps),
        grid=((rows + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[comb.shape],
        output_dtypes=[mx.float32],
    )
    return out
