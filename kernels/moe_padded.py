"""The padded MoE layout's device work around its gemms (engine/model/moe.py): a plain-MLX reference and,
for MLX's CUDA backend, one kernel each for

- **the combine**: every pair's row of the padded output block, weighted and summed over a token's k
  slots, `out[t] = Σ_j w[t, j] · float32(rows[slot[t·k + j]])`. The reference gathers the [T·k, D] rows
  (268 MB at 4,096 V4 Flash tokens in bf16), then multiplies into a [T, k, D] float32 transient (400 MB)
  and sums it: on the H200 0.32 + 0.55 ms (docs/BENCHMARKS.md "Session 6 on the H200 … final lease").
  The kernel reads each row once and writes only [T, D]. Same bits: MLX 0.32's CUDA sum over axis 1
  of a contiguous [T, k, D] array (2 ≤ k ≤ 32) is `col_reduce_small` (mlx/backend/cuda/reduce/
  col_reduce.cu), one thread per output element adding the k products in slot order onto 0; the
  products come from a separate elementwise kernel, one rounding each (MLX compiles no reduction into a
  fused kernel). The kernel does exactly that, with __fmul_rn / __fadd_rn so that the compiler cannot
  contract a product and an add into one FMA (one rounding fewer: other bits).
- **the index tables**: for each padded row the token it reads, and for each pair its padded row, from
  the expert-sorted pair order, the per-expert counts and the plan's two capacities. The reference
  builds them on the host from the counts (moe.padded_tables), uploads a [rows] and a [P] table and runs
  four small device ops (a gather, a division, a fill, a scatter): ~1 ms on the H200 with the host's
  table work. The kernel is one launch reading `order`, `flat` and the counts where they are on the
  device, with the two capacities as its only upload (8 bytes). Integers: the same values or a bug.

`moe_output` is the MoE's output from the combine's float32 sum and the shared expert's rows, both layouts' (and
kernels/hc_expand.py's, which makes it inside the FFN half's expand on a decode batch).

Switches: TESSERA_MOE_COMBINE_KERNEL=0 / TESSERA_MOE_INDEX_KERNEL=0 keep each reference on CUDA too (1, the
default, uses the kernel where it is supported).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, on_cuda
from tessera.kernels.row_gather import take_rows
from tessera.kernels.shapeless import shapeless
from tessera.kernels.switch import Switch

COMBINE_ENV_VAR = "TESSERA_MOE_COMBINE_KERNEL"
INDEX_ENV_VAR = "TESSERA_MOE_INDEX_KERNEL"
# On by default: on the H200 both kernels give the engine's bits at V4 Flash's shapes and take the padded
# MoE from 6.32 to 5.29 ms (docs/BENCHMARKS.md, "Session 7 on the H200 … final lease"), and every CUDA
# test of them passes, in one process and each alone (session 8; session 7's one fatal error in that
# file did not come back in either form).
_combine_switch = Switch(COMBINE_ENV_VAR)
_index_switch = Switch(INDEX_ENV_VAR)

VECTOR_BYTES = 16
THREADS = 256
FLOATS = (mx.bfloat16, mx.float16, mx.float32)
# col_reduce_small, whose order the combine kernel repeats, serves reductions of 2 to 32 rows (MLX copies
# a reduction over one row instead: no add onto 0, so -0.0 would stay).
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

@shapeless(sums_over=(1, 1))  # the k slots (top-1: plain, kernels/shapeless.py)
def weighted_sum(by_pair: mx.array, weights: mx.array) -> mx.array:
    """by_pair [T, k, D], weights [T, k] -> [T, D] float32: the definition of a token's routed output."""
    return (by_pair.astype(mx.float32) * weights[:, :, None]).sum(axis=1)


def moe_output(routed: mx.array, shared: mx.array, like: mx.array) -> mx.array:
    """routed [T, D] float32 (`weighted_sum`), shared [T, D] (the shared expert's rows) -> [T, D] in `like`'s dtype
    (the block input's): the MoE's output, the routed sum rounded before the shared rows are added."""
    return (routed.astype(like.dtype) + shared).astype(like.dtype)


def combine_rows_reference(rows: mx.array, slot: mx.array, weights: mx.array) -> mx.array:
    """rows: [R, D] (every padded row through its expert), slot: [T·k] (pair t·k + j's row), weights:
    [T, k] -> [T, D] float32: Σ_j weights[t, j] · rows[slot[t·k + j]]."""
    num_tokens, k = weights.shape
    return weighted_sum(take_rows(rows, slot).reshape(num_tokens, k, rows.shape[-1]), weights)


def combine_is_supported(rows: mx.array, slot: mx.array, weights: mx.array) -> bool:
    return (_combine_switch.enabled() and on_cuda() and rows.ndim == 2 and slot.ndim == 1 and weights.ndim == 2
            and rows.dtype in FLOATS and (rows.shape[1] * rows.dtype.size) % VECTOR_BYTES == 0
            and slot.dtype in (mx.int32, mx.uint32) and MIN_SLOTS <= weights.shape[1] <= MAX_SLOTS
            and slot.shape[0] == weights.shape[0] * weights.shape[1] and weights.dtype in FLOATS)


def combine_rows(rows: mx.array, slot: mx.array, weights: mx.array) -> mx.array:
    """`combine_rows_reference`, through the kernel where it is supported."""
    if not combine_is_supported(rows, slot, weights) or weights.shape[0] == 0 or rows.shape[1] == 0:
        return combine_rows_reference(rows, slot, weights)
    return combine_rows_kernel(rows, slot, weights)


# One thread per 16-byte vector of a token's row (ELEMS elements): it loads that vector of each of the
# token's K rows, in slot order, adds its products onto 0 as col_reduce_small does and writes the float32
# sums. Rows start 16-byte aligned (a row is a whole number of vectors, as in kernels/row_gather.py).
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
  const size_t first = token * (size_t)(VECTORS_PER_ROW * ELEMS) + v * ELEMS;  // this thread's first output element
  float4* dst = reinterpret_cast<float4*>(out + first);
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

def index_is_supported(order: mx.array, flat: mx.array, counts: mx.array) -> bool:
    return (_index_switch.enabled() and on_cuda() and order.ndim == 1 and flat.ndim == 1 and counts.ndim == 1
            and order.dtype in (mx.int32, mx.uint32) and flat.dtype in (mx.int32, mx.uint32)
            and counts.dtype in (mx.int32, mx.uint32) and 0 < counts.shape[0] <= MAX_EXPERTS)


# The per-expert table lives in shared memory, one thread per expert: E <= one block.
MAX_EXPERTS = 1024

# Every block first rebuilds the plan's per-expert table in shared memory from the device's counts (a
# Hillis-Steele scan, log2 E steps): each expert's first sorted position, its rank among the overflow
# experts (those with more than C pairs: moe.plan_padded's definition) and the overflow experts in order.
# Then threads [0, rows): padded row r finds its expert e and rank and reads the token at sorted position
# starts[e] + rank, or sorted position 0's if r is padding (any real token: never read back); threads
# [rows, rows + P): sorted position i writes its pair's row (one write per pair: order is a permutation).
_INDEX_SOURCE = r"""
  __shared__ int s_count[E];
  __shared__ int s_start[E];
  __shared__ int s_over[E];
  __shared__ int s_over_expert[E];
  const int cap = params[0], over_cap = params[1];
  const int tid = threadIdx.x;
  int own_count = 0, own_over = 0;
  if (tid < E) {
    own_count = (int)counts[tid];
    own_over = own_count > cap ? 1 : 0;
    s_count[tid] = own_count;
    s_start[tid] = own_count;
    s_over[tid] = own_over;
  }
  __syncthreads();
  for (int off = 1; off < E; off <<= 1) {  // inclusive scans of the counts and of the overflow flags
    int a = 0, b = 0;
    if (tid < E && tid >= off) {
      a = s_start[tid - off];
      b = s_over[tid - off];
    }
    __syncthreads();
    if (tid < E && tid >= off) {
      s_start[tid] += a;
      s_over[tid] += b;
    }
    __syncthreads();
  }
  const int num_over = s_over[E - 1];
  __syncthreads();
  if (tid < E) {  // exclusive: each thread rewrites only its own expert's entries
    s_start[tid] -= own_count;
    s_over[tid] -= own_over;
    if (own_over) s_over_expert[s_over[tid]] = tid;
  }
  __syncthreads();
  const int main_rows = E * cap;
  const int num_rows = main_rows + num_over * over_cap;
  const int num_pairs = order_shape[0];
  const int t = blockIdx.x * blockDim.x + tid;
  if (t < num_rows) {
    int e, rank;
    if (t < main_rows) {
      e = t / cap;
      rank = t % cap;
    } else {
      const int r = t - main_rows;
      e = s_over_expert[r / over_cap];
      rank = cap + r % over_cap;
    }
    const int pos = rank < s_count[e] ? s_start[e] + rank : 0;
    tokens[t] = (int)(order[pos] / K);
  } else if (t < num_rows + num_pairs) {
    const int i = t - num_rows;
    const int pair = (int)order[i];
    const int e = (int)flat[pair];
    const int rank = i - s_start[e];
    slot[pair] = rank < cap ? e * cap + rank : main_rows + s_over[e] * over_cap + rank - cap;
  }
"""


def padded_indices_kernel(order: mx.array, flat: mx.array, counts: mx.array, capacity: int, overflow_capacity: int,
                          num_rows: int, k: int) -> tuple[mx.array, mx.array]:
    """order: [P] the expert-sorted pair order (argsort(flat)), flat: [P] expert per pair (pair = t·k + j),
    counts: [E] pairs per expert on the device (the counts the plan came from), the plan's capacities and
    rows (moe.PaddedPlan; its overflow experts are those with more than `capacity` pairs) -> (tokens
    [rows] int32: the token each padded row reads, slot [P] int32: each pair's padded row)."""
    num_pairs, num_experts = order.shape[0], counts.shape[0]
    # 8 bytes: MLX's CUDA allocator puts arrays this small in its pool of managed memory that the device
    # reads in place (no page migration, as a larger array made on the host would need).
    params = mx.array([capacity, overflow_capacity], dtype=mx.int32)
    threads = max(THREADS, -(-num_experts // 32) * 32)  # the table's scan needs a thread per expert
    total = num_rows + num_pairs
    kernel = compiled_kernel("tessera_moe_padded_indices", ("order", "flat", "counts", "params"), ("tokens", "slot"),
                             _INDEX_SOURCE, "")
    tokens, slot = kernel(
        inputs=[order, flat, counts, params],
        template=[("E", num_experts), ("K", k)],
        grid=((total + threads - 1) // threads * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(num_rows,), (num_pairs,)],
        output_dtypes=[mx.int32, mx.int32],
    )
    return tokens, slot
