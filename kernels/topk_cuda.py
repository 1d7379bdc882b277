"""Top-k of the indexer's scores for MLX's CUDA backend: a radix select instead of a full sort.

Same result as `tessera.kernels.indexer.select_topk_reference` (the k best rows, ties to the lower index,
returned in ascending order): one block of 1024 threads per query row
1. finds the k-th largest score by four 8-bit radix passes over the row's order-preserving integer
   keys (histograms in shared memory, one atomic per distinct digit per warp), which also says how
   many rows tie with it and how many of those fit (`need`);
2. counts, per warp-owned contiguous stretch of the row, the rows above the k-th score and the ties;
3. walks the stretches again writing the selected row indices straight into their ascending slots
   (rows above the k-th score, and the first `need` ties in index order).
Six coalesced reads of the row and a [T, k] int32 output: no [T, N] sort scratch, no full sort. The picks'
validity (a pick at or past the row's `visible` count) is written beside them, `rows < visible[:, None]` in the
same launch: in MLX that was a comparison kernel and two views a CSA layer in every decode step
(docs/BENCHMARKS.md, "Session 35").
A row's picks depend only on that row, so tiles stay bit-identical whatever T is (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, on_cuda

THREADS = 1024  # one block per query row
WARPS = THREADS // 32

_HEADER = r"""
// Order-preserving map float -> uint32 (larger float, larger key); -0.0 counts as +0.0, as a float
// comparison (and the reference's sort) sees them.
__device__ __forceinline__ unsigned int order_key(float f) {
  const unsigned int bits = __float_as_uint(f == 0.f ? 0.f : f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
"""

_SOURCE = r"""
  constexpr int NT = 1024, NWARPS = NT / 32, BINS = 256;
  __shared__ unsigned int hist[BINS];
  __shared__ unsigned int warp_above[NWARPS], warp_ties[NWARPS];
  __shared__ unsigned int s_prefix, s_remaining;

  const int row = blockIdx.x;
  const int n = scores_shape[1];
  const unsigned int k = (unsigned int)k_in[0];
  const float* x = scores + (size_t)row * n;
  const int vis = (int)visible[row];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  // 1. The k-th largest key, 8 bits at a time from the top.
  unsigned int prefix = 0, prefix_mask = 0, remaining = k;  // remaining: its rank among keys matching prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < BINS; i += NT) hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += NT) {
      const int i = base + tid;
      const unsigned int key = i < n ? order_key(x[i]) : 0u;
      const bool take = i < n && (key & prefix_mask) == prefix;
      const unsigned int digit = take ? (key >> shift) & 0xFFu : 0x100u;
      const unsigned int peers = __match_any_sync(0xFFFFFFFFu, digit);
      if (take && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    if (tid == 0) {
      unsigned int above = 0;
      int bin = BINS - 1;
      for (; bin > 0; --bin) {
        if (above + hist[bin] >= remaining) break;
        above += hist[bin];
      }
      s_prefix = prefix | ((unsigned int)bin << shift);
      s_remaining = remaining - above;
    }
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    prefix_mask |= 0xFFu << shift;
  }
  const unsigned int kth = prefix, need = remaining;  // take the first `need` rows whose key is kth

  // 2. Per warp, over its contiguous stretch: rows above kth, rows tied with it.
  const int stretch = ((n + NWARPS - 1) / NWARPS + 31) / 32 * 32;
  const int lo = min(warp * stretch, n), hi = min(lo + stretch, n);
  unsigned int above = 0, ties = 0;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    const unsigned int key = i < hi ? order_key(x[i]) : 0u;
    above += __popc(__ballot_sync(0xFFFFFFFFu, i < hi && key > kth));
    ties += __popc(__ballot_sync(0xFFFFFFFFu, i < hi && key == kth));
  }
  if (lane == 0) { warp_above[warp] = above; warp_ties[warp] = ties; }
  __syncthreads();

  // 3. Write the picks in index order: a pick's slot = picks in earlier stretches + earlier lanes.
  unsigned int above_before = 0, ties_before = 0;
  for (int w = 0; w < warp; ++w) { above_before += warp_above[w]; ties_before += warp_ties[w]; }
  unsigned int slot = above_before + min(ties_before, need);
  const unsigned int lower_lanes = (1u << lane) - 1u;
  int* out = rows + (size_t)row * k;
  bool* out_valid = valid + (size_t)row * k;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    const unsigned int key = i < hi ? order_key(x[i]) : 0u;
    const bool tie = i < hi && key == kth;
    const unsigned int tie_mask = __ballot_sync(0xFFFFFFFFu, tie);
    const bool pick = (i < hi && key > kth) || (tie && ties_before + __popc(tie_mask & lower_lanes) < need);
    const unsigned int pick_mask = __ballot_sync(0xFFFFFFFFu, pick);
    if (pick) {
      const unsigned int at = slot + __popc(pick_mask & lower_lanes);
      out[at] = i;
      out_valid[at] = i < vis;
    }
    ties_before += __popc(tie_mask);
    slot += __popc(pick_mask);
  }
"""

def _kernel():
    return compiled_kernel("tessera_topk_radix", ("scores", "k_in", "visible"), ("rows", "valid"), _SOURCE, _HEADER)


def is_supported(scores: mx.array) -> bool:
    return on_cuda() and scores.dtype == mx.float32


def launch_shape(num_q: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in MLX's convention (the grid counts threads): one block per query row."""
    return (num_q * THREADS, 1, 1), (THREADS, 1, 1)


def warp_stretch(n: int) -> int:
    """Row entries each warp owns in passes 2 and 3 (a multiple of 32, so every ballot is whole);
    the same formula as the kernel's `stretch`."""
    return ((n + WARPS - 1) // WARPS + 31) // 32 * 32


def select_topk_kernel(scores: mx.array, visible: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """scores: [T, N] fp32, visible: [T] int32 -> (rows [T, min(k, N)] int32 ascending, valid [T, min(k, N)] bool)."""
    num_q, num_rows = scores.shape
    k = min(k, num_rows)
    if num_q == 0 or k == 0:
        rows = mx.zeros((num_q, k), dtype=mx.int32)
        return rows, rows < visible[:, None]
    rows, valid = _kernel()(
        inputs=[scores, mx.array([k], dtype=mx.int32), visible.astype(mx.int32)],
        grid=launch_shape(num_q)[0],
        threadgroup=launch_shape(num_q)[1],
        output_shapes=[(num_q, k), (num_q, k)],
        output_dtypes=[mx.int32, mx.bool_],
    )
    return rows, valid
