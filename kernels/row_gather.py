"""Row gathers, `x[idx]` for a 2-D `x` and 1-D indices: a plain-MLX reference and, for MLX's CUDA
backend, a kernel that moves 16 bytes per thread.

The MoE's padded layout gathers every (token, expert) pair's row into its expert's block and every
pair's output back (engine/model/moe.py): at V4 Flash widths and 4,096 rows, 268 MB each way per
layer. MLX 0.32's CUDA Gather runs one thread per element (2 bytes of bf16) with a division and a
strided index computation per element; on the H200 the two gathers took 1.1 and 0.9 ms, ~0.25 TB/s
(docs/BENCHMARKS.md, "Session 6 on the H200 … the MoE's parts"). The kernel copies whole 16-byte
vectors of a row. A gather is a copy, so kernel and reference give the same bits
(tests/test_kernels_cuda.py, and `check kernels`).

Switch: TESSERA_ROW_GATHER_KERNEL=0 keeps MLX's gather on CUDA too (1, the default, uses the kernel
where it is supported: CUDA, rows a whole number of 16-byte vectors). The decode batch's gather
(`take_rows_batched_kernel`) also needs TESSERA_DECODE_BATCH_KERNELS (kernels/cuda.py) on, and
TESSERA_DECODE_BATCH_GATHER (default 1): a decode batch's CSA selected rows and an HCA batch's every
compressed row take one launch each (engine/model/decode_attention.py) instead of a gather or a copy per
sequence. The same bits; on the H200 the serving step at batch 16 and 16k took 5.50 ms with it against 6.10
without (A B B A in one process, one host; two noisier hosts resolved no difference: docs/BENCHMARKS.md,
"Session 16 on the H200"). Session 8, before the step was bound by the host's launches, had seen none either;
=0 takes the per-sequence path.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, decode_batch_kernels, input_slots, on_cuda
from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_ROW_GATHER_KERNEL"
_switch = Switch(ENV_VAR)
BATCH_ENV_VAR = "TESSERA_DECODE_BATCH_GATHER"
_batch_switch = Switch(BATCH_ENV_VAR)


def batch_gather_enabled() -> bool:
    return _batch_switch.enabled()


def set_batch_gather_enabled(enabled: bool) -> None:
    _batch_switch.set(enabled)

VECTOR_BYTES = 16
THREADS = 256


def set_kernel_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def kernel_enabled() -> bool:
    return _switch.enabled()


def take_rows_reference(x: mx.array, idx: mx.array) -> mx.array:
    """x: [N, D], idx: [M] integers in [0, N) -> [M, D]: row idx[i] of x at row i."""
    return x[idx]


def is_supported(x: mx.array, idx: mx.array) -> bool:
    return (_switch.enabled() and on_cuda() and x.ndim == 2 and idx.ndim == 1
            and (x.shape[1] * x.dtype.size) % VECTOR_BYTES == 0 and idx.dtype in (mx.int32, mx.uint32))


def take_rows(x: mx.array, idx: mx.array) -> mx.array:
    """`take_rows_reference`, through the kernel where it is supported."""
    if not is_supported(x, idx) or idx.shape[0] == 0 or x.shape[1] == 0:
        return take_rows_reference(x, idx)
    return take_rows_kernel(x, idx)


# One thread per 16-byte vector of the output; a row is VECTORS_PER_ROW vectors. MLX hands the kernel
# row-contiguous inputs whose rows start 16-byte aligned (a row is a whole number of vectors).
_SOURCE = r"""
  const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (size_t)idx_shape[0] * VECTORS_PER_ROW) return;
  const size_t row = t / VECTORS_PER_ROW;
  const size_t source = (size_t)idx[row] * VECTORS_PER_ROW + t % VECTORS_PER_ROW;
  reinterpret_cast<uint4*>(out)[t] = reinterpret_cast<const uint4*>(x)[source];
"""


def take_rows_kernel(x: mx.array, idx: mx.array) -> mx.array:
    """x: [N, D] on a CUDA device (D · itemsize a multiple of 16 bytes), idx: [M] int32/uint32 -> [M, D]."""
    vectors_per_row = x.shape[1] * x.dtype.size // VECTOR_BYTES
    total = idx.shape[0] * vectors_per_row
    kernel = compiled_kernel("tessera_take_rows", ("x", "idx"), ("out",), _SOURCE, "")
    (out,) = kernel(
        inputs=[x, idx],
        template=[("VECTORS_PER_ROW", vectors_per_row)],
        grid=((total + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(idx.shape[0], x.shape[1])],
        output_dtypes=[x.dtype],
    )
    return out


# A decode batch's selected rows, each sequence's from its own buffer where it lies (no stacked copy of
# every buffer, no gather per sequence): the kernel is generated per NB = cuda.input_slots(B) ≤ MAX_BATCH
# with inputs x0 … x{NB-1} (`mx.fast.cuda_kernel` takes a fixed list of inputs; slots past B repeat the
# last buffer and get no blocks); larger batches run in chunks.
MAX_BATCH = 16

_BATCHED_SOURCE = r"""
  const int seq = blockIdx.z;
  const size_t num_picks = idx_shape[1];
  const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= num_picks * VECTORS_PER_ROW) return;
  const auto* x = x0;
  switch (seq) {
{cases}
  }
  const size_t row = t / VECTORS_PER_ROW;
  const size_t source = (size_t)idx[seq * num_picks + row] * VECTORS_PER_ROW + t % VECTORS_PER_ROW;
  reinterpret_cast<uint4*>(out)[seq * num_picks * VECTORS_PER_ROW + t] = reinterpret_cast<const uint4*>(x)[source];
"""


def take_rows_batched_reference(xs: list[mx.array], idx: mx.array) -> mx.array:
    """xs: B × [N_b, D], idx: [B, K] (row b's entries < N_b) -> [B, K, D]: xs[b][idx[b]] at [b]."""
    return mx.stack([x[i] for x, i in zip(xs, idx)])


def batch_is_supported(xs: list[mx.array], idx: mx.array) -> bool:
    """`take_rows_batched_kernel` runs here: CUDA, both switches on, idx [B, K > 0] int32/uint32, and
    buffers of one width and dtype whose rows are whole 16-byte vectors."""
    first = xs[0]
    return (_switch.enabled() and decode_batch_kernels.enabled() and _batch_switch.enabled() and on_cuda()
            and idx.ndim == 2 and idx.shape[0] == len(xs) and idx.shape[1] > 0 and idx.dtype in (mx.int32, mx.uint32)
            and (first.shape[1] * first.dtype.size) % VECTOR_BYTES == 0
            and all(x.ndim == 2 and x.shape[1] == first.shape[1] and x.dtype == first.dtype for x in xs))


def _batched_kernel(num_seqs: int):
    return compiled_kernel(*_batched_kernel_text(num_seqs), "")


@cache
def _batched_kernel_text(num_seqs: int) -> tuple[str, tuple[str, ...], tuple[str, ...], str]:
    """(name, inputs, outputs, source) for `num_seqs` buffers, made once: `compiled_kernel`'s cache is keyed
    by them, and a source string made anew every step would be hashed anew every step."""
    cases = "\n".join(f"    case {b}: x = x{b}; break;" for b in range(1, num_seqs))
    inputs = ("idx", *(f"x{b}" for b in range(num_seqs)))
    return f"tessera_take_rows_batched_{num_seqs}", inputs, ("out",), _BATCHED_SOURCE.replace("{cases}", cases)


def take_rows_batched_kernel(xs: list[mx.array], idx: mx.array) -> mx.array:
    """`take_rows_batched_reference` on a CUDA device (rows a whole number of 16-byte vectors), each
    buffer read in place (rows past the largest index are never read)."""
    num_picks, width = idx.shape[1], xs[0].shape[1]
    vectors_per_row = width * xs[0].dtype.size // VECTOR_BYTES
    total = num_picks * vectors_per_row
    parts = []
    for lo in range(0, len(xs), MAX_BATCH):
        hi = min(lo + MAX_BATCH, len(xs))
        slots = input_slots(hi - lo)
        (out,) = _batched_kernel(slots)(
            inputs=[idx if (lo, hi) == (0, len(xs)) else idx[lo:hi], *xs[lo:hi], *xs[hi - 1 : hi] * (slots - (hi - lo))],
            template=[("VECTORS_PER_ROW", vectors_per_row)],
            grid=((total + THREADS - 1) // THREADS * THREADS, 1, hi - lo),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(hi - lo, num_picks, width)],
            output_dtypes=[xs[0].dtype],
        )
        parts.append(out)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
