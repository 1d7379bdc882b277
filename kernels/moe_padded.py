"""The padded MoE layout's device work around its gemms (engine/model/moe.py): a plain-MLX reference and,
for MLX's CUDA backend, one kernel each for

- **the combine**: every pair's row of the padded output block, weighted and summed over a token's k
  slots, `out[t] = Σ_j w[t, j] · float32(rows[slot[t·k + j]])`. The reference gathers the [T·k, D] rows
  (268 MB at 4,096 V4 Flash tokens in bf16), then multiplies into a [T, k, D] float32 transient (400 MB)
  and sums it: on the H200 0.32 + 0.55 ms (docs/BENCHMARKS.md "Session 6 on the H200 … final lease").
  The kernel reads each row once and writes only [T, D]. Same bits: MLX 0.32's CUDA sum over axis 1
  of a contiguous [T, k ≤ 32, D] array is `col_reduce_small` (mlx/backend/cuda/reduce/col_reduce.cu),
  one thread per output element adding the k products in slot order onto 0; the products come from a
  separate elementwise kernel, one rounding each (MLX compiles no reduction into a fused kernel). The
  kernel does exactly that, with __fmul_rn / __fadd_rn so that the compiler cannot contract a
  product and an add into one FMA (one rounding fewer: other bits).
- **the index tables**: for each padded row the token it reads, and for each pair its padded row, from
  the expert-sorted pair order and the per-expert counts (`PaddedIndexMeta`). The reference builds them
  on the host from the counts (moe.padded_tables), uploads a [rows] and a [P] table and runs four small
  device ops (a gather, a division, a fill, a scatter): ~1 ms on the H200 with the host's table work.
  The kernel is one launch reading `order` and `flat` where they are, with a 4·(4E + 3)-byte upload.
  Integers: the same values or a bug.

Switches: TESSERA_MOE_COMBINE_KERNEL=0 / TESSERA_MOE_INDEX_KERNEL=0 keep the references on CUDA too (1,
the default, uses each kernel where it is supported).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tessera.engine.model.compiled import shapeless
from tessera.kernels.cuda import compiled_kernel, on_cuda
from tessera.kernels.row_gather import take_rows
from tessera.kernels.switch import Switch

COMBINE_ENV_VAR = "TESSERA_MOE_COMBINE_KERNEL"
INDEX_ENV_VAR = "TESSERA_MOE_INDEX_KERNEL"
_combine_switch = Switch(COMBINE_ENV_VAR)
_index_switch = Switch(INDEX_ENV_VAR)

VECTOR_BYTES = 16
THREADS = 256
# col_reduce_small, whose order the combine kernel repeats, serves reductions of 2 to 32 rows (MLX copies
# a reduction over one row instead: no add onto 0, so -0.0 would stay; and MLX 0.32's CPU crashed on the
# shapeless weighted_sum at k = 1, so the reference could not be tested there).
MIN_SLOTS, MAX_SLOTS = 2, 32


def set_combine_kernel_enabled(enabled: bool) -> None:
    _combine_switch.set(enabled)


def combine_kernel_enabled() -> bool:
    return _combine_switch.enabled()


def set_index_kernel_enabled(enabled: bool) -> None:
    _index_switch.set(enabled)


def index_kernel_enabled() -> bool:
    return _index_switch.enabled()


# ---------------------------------------------------------------------------------------------------
# The combine.

@shapeless
def weighted_sum(by_pair: mx.array, weights: mx.array) -> mx.array:
    """by_pair [T, k, D], weights [T, k] -> [T, D] float32: the definition of a token's routed output."""
    return (by_pair.astype(mx.float32) * weights[:, :, None]).sum(axis=1)


def combine_rows_reference(rows: mx.array, slot: mx.array, weights: mx.array) -> mx.array:
    """rows: [R, D] (every padded row through its expert), slot: [T·k] (pair t·k + j's row), weights:
    [T, k] -> [T, D] float32: Σ_j weights[t, j] · rows[slot[t·k + j]]."""
    num_tokens, k = weights.shape
    return weighted_sum(take_rows(rows, slot).reshape(num_tokens, k, rows.shape[-1]), weights)


def combine_is_supported(rows: mx.array, slot: mx.array, weights: mx.array) -> bool:
    return (_combine_switch.enabled() and on_cuda() and rows.ndim == 2 and slot.ndim == 1 and weights.ndim == 2
            and rows.dtype in (mx.bfloat16, mx.float16, mx.float32) and (rows.shape[1] * rows.dtype.size) % VECTOR_BYTES == 0
            and slot.dtype in (mx.int32, mx.uint32) and MIN_SLOTS <= weights.shape[1] <= MAX_SLOTS
            and slot.shape[0] == weights.shape[0] * weights.shape[1]
            and weights.dtype in (mx.float32, mx.bfloat16, mx.float16))


def combine_rows(rows: mx.array, slot: mx.array, weights: mx.array) -> mx.array:
    """`combine_rows_reference`, through the kernel where it is supported."""
    if not combine_is_supported(rows, slot, weights) or weights.shape[0] == 0 or rows.shape[1] == 0:
        return combine_rows_reference(rows, slot, weights)
    return combine_rows_kernel(rows, slot, weights)


# One thread per 16-byte vector of a token's row (ELEMS elements): it loads that vector of each of the
# token's K rows, in slot order, and adds its products onto 0 as col_reduce_small does. Rows start
# 16-byte aligned (a row is a whole number of vectors, as in kernels/row_gather.py).
_COMBINE_SOURCE = r"""
  constexpr int ELEMS = 16 / sizeof(T);
  const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (size_t)weights_shape[0] * VECTORS_PER_ROW) return;
  const size_t token = t / VECTORS_PER_ROW;
  const size_t v = t % VECTORS_PER_ROW;
  float acc[ELEMS];
  #pragma unroll
  for (int i = 0; i < ELEMS; ++i) acc[i] = 0.0f;
  #pragma unroll
  for (int j = 0; j < K; ++j) {
    const float w = weights[token * K + j];
    const size_t row = (size_t)slot[token * K + j];
    const uint4 raw = reinterpret_cast<const uint4*>(rows)[row * VECTORS_PER_ROW + v];
    const T* vals = reinterpret_cast<const T*>(&raw);
    #pragma unroll
    for (int i = 0; i < ELEMS; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(static_cast<float>(vals[i]), w));
  }
  float4* dst = reinterpret_cast<float4*>(out + token * (size_t)(VECTORS_PER_ROW * ELEMS) + v * ELEMS);
  #pragma unroll
  for (int q = 0; q < ELEMS / 4; ++q) dst[q] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
"""


def combine_rows_kernel(rows: mx.array, slot: mx.array, weights: mx.array) -> mx.array:
    """rows: [R, D] bf16/fp16/fp32 on a CUDA device (D · itemsize a multiple of 16 bytes), slot: [T·k]
    int32/uint32, weights: [T, k] -> [T, D] float32."""
    num_tokens, k = weights.shape
    vectors_per_row = rows.shape[1] * rows.dtype.size // VECTOR_BYTES
    total = num_tokens * vectors_per_row
    kernel = compiled_kernel("tessera_moe_combine_rows", ("rows", "slot", "weights"), ("out",), _COMBINE_SOURCE, "")
    (out,) = kernel(
        inputs=[rows, slot, weights.astype(mx.float32)],  # exact; the reference multiplies in float32 too
        template=[("T", rows.dtype), ("K", k), ("VECTORS_PER_ROW", vectors_per_row)],
        grid=((total + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(num_tokens, rows.shape[1])],
        output_dtypes=[mx.float32],
    )
    return out


# ---------------------------------------------------------------------------------------------------
# The index tables.

@dataclass(frozen=True)
class PaddedIndexMeta:
    """What the index kernel needs of a padded plan, as one int32 array (`values`): capacity C, overflow
    capacity C_o, rows in all, then per expert its first sorted position, its count, its first overflow
    row (E·C + i·C_o for the i-th overflow expert; unused for the others), then the overflow experts."""
    values: np.ndarray  # [3 + 4E] int32
    num_rows: int


def padded_index_meta(counts: np.ndarray, capacity: int, overflow: tuple[int, ...], overflow_capacity: int) -> PaddedIndexMeta:
    """counts: [E] pairs per expert, the plan's capacities and overflow experts (moe.PaddedPlan)."""
    num_experts = len(counts)
    counts = counts.astype(np.int64)
    starts = np.cumsum(counts) - counts
    over_row = np.zeros(num_experts, dtype=np.int64)
    over_row[list(overflow)] = num_experts * capacity + np.arange(len(overflow)) * overflow_capacity
    over_experts = np.zeros(num_experts, dtype=np.int64)
    over_experts[: len(overflow)] = overflow
    num_rows = num_experts * capacity + len(overflow) * overflow_capacity
    values = np.concatenate([[capacity, overflow_capacity, num_rows], starts, counts, over_row, over_experts])
    return PaddedIndexMeta(values.astype(np.int32), num_rows)


def index_is_supported(order: mx.array, flat: mx.array) -> bool:
    return (_index_switch.enabled() and on_cuda() and order.ndim == 1 and flat.ndim == 1
            and order.dtype in (mx.int32, mx.uint32) and flat.dtype in (mx.int32, mx.uint32))


# Threads [0, rows): padded row r reads the token of sorted position starts[e] + rank (its expert e and
# rank from r), or of sorted position 0 if r is padding (any real token: never read back). Threads
# [rows, rows + P): sorted position i writes its pair's row (one write per pair: order is a permutation).
_INDEX_SOURCE = r"""
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int cap = meta[0], over_cap = meta[1], num_rows = meta[2];
  const int* starts = meta + 3;
  const int* counts = starts + E;
  const int* over_row = counts + E;
  const int* over_experts = over_row + E;
  const int num_pairs = order_shape[0];
  if (t < num_rows) {
    int e, rank;
    if (t < E * cap) {
      e = t / cap;
      rank = t % cap;
    } else {
      const int r = t - E * cap;
      e = over_experts[r / over_cap];
      rank = cap + r % over_cap;
    }
    const int pos = rank < counts[e] ? starts[e] + rank : 0;
    tokens[t] = (int)(order[pos] / K);
  } else if (t < num_rows + num_pairs) {
    const int i = t - num_rows;
    const int pair = (int)order[i];
    const int e = (int)flat[pair];
    const int rank = i - starts[e];
    slot[pair] = rank < cap ? e * cap + rank : over_row[e] + rank - cap;
  }
"""


def padded_indices_kernel(order: mx.array, flat: mx.array, meta: PaddedIndexMeta, k: int) -> tuple[mx.array, mx.array]:
    """order: [P] the expert-sorted pair order (argsort(flat)), flat: [P] expert per pair (pair = t·k + j)
    -> (tokens [rows] int32: the token each padded row reads, slot [P] int32: each pair's padded row)."""
    num_pairs = order.shape[0]
    num_experts = (len(meta.values) - 3) // 4
    total = meta.num_rows + num_pairs
    kernel = compiled_kernel("tessera_moe_padded_indices", ("order", "flat", "meta"), ("tokens", "slot"), _INDEX_SOURCE, "")
    tokens, slot = kernel(
        inputs=[order, flat, mx.array(meta.values)],
        template=[("E", num_experts), ("K", k)],
        grid=((total + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(meta.num_rows,), (num_pairs,)],
        output_dtypes=[mx.int32, mx.int32],
    )
    return tokens, slot
