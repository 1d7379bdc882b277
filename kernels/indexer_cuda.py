"""Fused lightning-indexer scoring for MLX's CUDA backend (tensor cores, bf16 in, fp32 out).

scores[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]), with rows s ≥ visible[t] set to -inf, computed
without materializing per-head scores: each block owns 32 query rows × 256 key rows; every warp keeps
its 32 keys' bf16 fragments in registers for the whole head loop, the block stages one head's query
tile in shared memory at a time, and `mma.sync.m16n8k16` (bf16 × bf16 → fp32) produces the per-head
dot products that are ReLU'd, weighted and summed in registers in a fixed head order. A row's score
depends only on that row, so tiles stay bit-identical whatever T is (docs/ARCHITECTURE.md).

The reference is `tessera.kernels.indexer.indexer_scores_reference`; `tessera.kernels.indexer.indexer_scores`
dispatches here on a CUDA device when the shapes fit (`shapes_fit`: index_head_dim a multiple of 16
and ≤ 256, and the block's query tile plus every head weight within 48 KiB of static shared memory).
"""

from __future__ import annotations

from functools import cache
from typing import Sequence

import mlx.core as mx

from tessera.kernels.cuda import (
    SHARED_MEMORY_LIMIT, compiled_kernel, decode_batch_kernels, input_slots, on_cuda,
)

QUERIES_PER_BLOCK = 32  # two m16 tiles
KEYS_PER_WARP = 32  # four n8 tiles
WARPS = 8
KEYS_PER_BLOCK = KEYS_PER_WARP * WARPS
PAD = 8  # bf16 elements of padding per shared-memory row: spreads rows over the 32 banks

_HEADER = r"""
#include <cuda_bf16.h>

__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned int* a, const unsigned int* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"""

# Template constants: H (heads), D (head dim), KS = D / 16 (k-steps). The source is a preamble that
# names the tile's operands (q, w, k, visible, scores, num_q, num_k) and `_BODY`, the one scoring code
# both kernels run: the batched kernel's preamble points them at one sequence, so each of its scores is
# the single kernel's arithmetic, in the same order (batched == single bit for bit).
_DECLARATIONS = r"""
  constexpr int TQ = 32, KPW = 32, NW = 8, PADDED = D + 8;
  constexpr int LOADS = (TQ * D / 8 + NW * 32 - 1) / (NW * 32);  // 16-byte loads per thread per head
  __shared__ __align__(16) __nv_bfloat16 q_tile[TQ * PADDED];
  __shared__ float w_tile[TQ * H];
"""

_SINGLE_PREAMBLE = r"""
  const int num_q = q_shape[0];
  const int num_k = k_shape[0];"""

_BODY = r"""
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, tig = lane % 4;
  const int q0 = blockIdx.y * TQ;
  const int key0 = blockIdx.x * (KPW * NW) + warp * KPW;

  // Every head weight of the block's queries, once.
  for (int i = threadIdx.x; i < TQ * H; i += blockDim.x) {
    const int t = q0 + i / H;
    w_tile[i] = t < num_q ? w[(size_t)t * H + i % H] : 0.f;
  }

  // This warp's keys as mma B fragments, held for every head: b[n][ks][2].
  unsigned int b[4][KS][2];
  for (int n = 0; n < 4; ++n) {
    const int key = key0 + n * 8 + group;
    const unsigned int* row = reinterpret_cast<const unsigned int*>(k + (size_t)min(key, num_k - 1) * D);
    for (int ks = 0; ks < KS; ++ks) {
      b[n][ks][0] = key < num_k ? row[(ks * 16 + tig * 2) / 2] : 0u;
      b[n][ks][1] = key < num_k ? row[(ks * 16 + 8 + tig * 2) / 2] : 0u;
    }
  }

  // One head's query tile [TQ, D] travels global -> registers (prefetched a head ahead) -> shared.
  uint4 staged[LOADS];
  auto fetch = [&](int h) {
    for (int j = 0; j < LOADS; ++j) {
      const int i = threadIdx.x + j * NW * 32;
      const int row = i / (D / 8), col = (i % (D / 8)) * 8;
      staged[j] = make_uint4(0u, 0u, 0u, 0u);
      if (i < TQ * D / 8 && q0 + row < num_q)
        staged[j] = *reinterpret_cast<const uint4*>(q + ((size_t)(q0 + row) * H + h) * D + col);
    }
  };
  fetch(0);

  float acc[2][4][4];
  for (int m = 0; m < 2; ++m) for (int n = 0; n < 4; ++n) for (int r = 0; r < 4; ++r) acc[m][n][r] = 0.f;

  for (int h = 0; h < H; ++h) {
    __syncthreads();  // the previous head's tile is no longer read
    for (int j = 0; j < LOADS; ++j) {
      const int i = threadIdx.x + j * NW * 32;
      if (i < TQ * D / 8)
        *reinterpret_cast<uint4*>(q_tile + (i / (D / 8)) * PADDED + (i % (D / 8)) * 8) = staged[j];
    }
    __syncthreads();
    if (h + 1 < H) fetch(h + 1);  // in flight while this head's tensor-core work runs
    for (int m = 0; m < 2; ++m) {
      float c[4][4];
      for (int n = 0; n < 4; ++n) for (int r = 0; r < 4; ++r) c[n][r] = 0.f;
      const __nv_bfloat16* top = q_tile + (m * 16 + group) * PADDED;
      const __nv_bfloat16* bottom = top + 8 * PADDED;
      for (int ks = 0; ks < KS; ++ks) {
        const int col = ks * 16 + tig * 2;
        unsigned int a[4];
        a[0] = *reinterpret_cast<const unsigned int*>(top + col);
        a[1] = *reinterpret_cast<const unsigned int*>(bottom + col);
        a[2] = *reinterpret_cast<const unsigned int*>(top + col + 8);
        a[3] = *reinterpret_cast<const unsigned int*>(bottom + col + 8);
        for (int n = 0; n < 4; ++n) mma_bf16_16816(c[n], a, b[n][ks]);
      }
      const float w_top = w_tile[(m * 16 + group) * H + h], w_bottom = w_tile[(m * 16 + group + 8) * H + h];
      for (int n = 0; n < 4; ++n) {
        acc[m][n][0] += w_top * fmaxf(c[n][0], 0.f);
        acc[m][n][1] += w_top * fmaxf(c[n][1], 0.f);
        acc[m][n][2] += w_bottom * fmaxf(c[n][2], 0.f);
        acc[m][n][3] += w_bottom * fmaxf(c[n][3], 0.f);
      }
    }
  }

  for (int m = 0; m < 2; ++m) {
    for (int half = 0; half < 2; ++half) {
      const int t = q0 + m * 16 + group + half * 8;
      if (t >= num_q) continue;
      const int vis = visible[t];
      for (int n = 0; n < 4; ++n) {
        const int s = key0 + n * 8 + tig * 2;
        for (int e = 0; e < 2; ++e) {
          if (s + e < num_k) scores[(size_t)t * num_k + s + e] = (s + e < vis) ? acc[m][n][half * 2 + e] : -__int_as_float(0x7f800000);
        }
      }
    }
  }
"""

_SOURCE = _DECLARATIONS + _SINGLE_PREAMBLE + _BODY


def _kernel():
    return compiled_kernel("tessera_indexer_scores", ("q", "w", "k", "visible"), ("scores",), _SOURCE, _HEADER)


# A decode batch: one query row per sequence, each scored against its own key buffer where it lies
# (stacking the buffers would copy every key each step). `mx.fast.cuda_kernel` takes a fixed list of
# inputs, so the kernel is generated per NB = cuda.input_slots(B) ≤ MAX_BATCH with inputs keys0 …
# keys{NB-1} (slots past B repeat the last buffer and get no blocks); larger batches run in chunks. Grid: x over key blocks of the widest sequence, z over sequences. `sizes` holds
# each sequence's key count and, last, the output width; columns from a sequence's key count to the
# width are -inf, and blocks wholly past its keys only write those.
MAX_BATCH = 16

_BATCHED_PREAMBLE = r"""
  const int seq = blockIdx.z;
  const int num_q = 1;
  const int num_k = sizes[seq];
  const int width = sizes[NB];
  const auto* q = qs + (size_t)seq * H * D;
  const float* w = ws + (size_t)seq * H;
  const int* visible = visibles + seq;
  float* scores = scores_all + (size_t)seq * width;
  const auto* k = keys0;
  switch (seq) {
{cases}
  }
  const int block_keys0 = blockIdx.x * (KPW * NW);
  for (int s = max(num_k, block_keys0) + (int)threadIdx.x; s < min(width, block_keys0 + KPW * NW); s += blockDim.x)
    scores[s] = -__int_as_float(0x7f800000);
  if (block_keys0 >= num_k) return;  // the whole block (num_k is uniform in it): no __syncthreads left behind"""


def _batched_kernel(num_seqs: int):
    return compiled_kernel(*_batched_kernel_text(num_seqs), _HEADER)


@cache
def _batched_kernel_text(num_seqs: int) -> tuple[str, tuple[str, ...], tuple[str, ...], str]:
    """(name, inputs, outputs, source) for `num_seqs` key buffers, made once: `compiled_kernel`'s cache is
    keyed by them, and a source string made anew every step would be hashed anew every step."""
    cases = "\n".join(f"    case {b}: k = keys{b}; break;" for b in range(1, num_seqs))
    source = _DECLARATIONS + _BATCHED_PREAMBLE.replace("{cases}", cases) + _BODY
    inputs = ("qs", "ws", "visibles", "sizes", *(f"keys{b}" for b in range(num_seqs)))
    return f"tessera_indexer_scores_batched_{num_seqs}", inputs, ("scores_all",), source


def indexer_scores_batched_kernel(
    q: mx.array, head_weights: mx.array, keys: Sequence[mx.array], num_keys: Sequence[int], visible: mx.array,
    scale: float,
) -> mx.array:
    """q: [B, heads, d], head_weights: [B, heads], keys: B × [≥ num_keys[b], d] (each sequence's buffer;
    rows past num_keys[b] unread), visible: [B] -> scores [B, max(num_keys)] fp32. Row b's first
    num_keys[b] columns are `indexer_scores_kernel(q[b:b+1], head_weights[b:b+1], keys[b][:num_keys[b]],
    visible[b:b+1], scale)` bit for bit; the rest are -inf."""
    num_seqs, heads, d = q.shape
    width = max(num_keys)
    w = head_weights.astype(mx.float32) * scale  # folded as the single kernel folds it
    q, visible = q.astype(mx.bfloat16), visible.astype(mx.int32)
    parts = []
    for lo in range(0, num_seqs, MAX_BATCH):
        hi = min(lo + MAX_BATCH, num_seqs)
        whole = lo == 0 and hi == num_seqs
        pick = (lambda a: a) if whole else (lambda a: a[lo:hi])  # noqa: E731
        grid, threadgroup = launch_shape(1, width)
        slots = input_slots(hi - lo)
        buffers = [k.astype(mx.bfloat16) for k in keys[lo:hi]]
        sizes = [*num_keys[lo:hi], *[0] * (slots - (hi - lo)), width]  # [slots + 1]: each N, then the width
        (scores,) = _batched_kernel(slots)(
            inputs=[pick(q), pick(w), pick(visible), mx.array(sizes, dtype=mx.int32),
                    *buffers, *buffers[-1:] * (slots - len(buffers))],
            template=[("H", heads), ("D", d), ("KS", d // 16), ("NB", slots)],
            grid=(grid[0], 1, hi - lo),
            threadgroup=threadgroup,
            output_shapes=[(hi - lo, width)],
            output_dtypes=[mx.float32],
        )
        parts.append(scores)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def shared_memory_bytes(heads: int, d: int) -> int:
    """The block's static shared memory: one head's padded bf16 query tile + every head weight."""
    return QUERIES_PER_BLOCK * (d + PAD) * 2 + QUERIES_PER_BLOCK * heads * 4


def shapes_fit(heads: int, d: int) -> bool:
    return d % 16 == 0 and 16 <= d <= 256 and 1 <= heads and shared_memory_bytes(heads, d) <= SHARED_MEMORY_LIMIT


def is_supported(q: mx.array) -> bool:
    """A CUDA device, and q's [.., heads, d] fit the kernel (`shapes_fit`)."""
    return on_cuda() and shapes_fit(q.shape[1], q.shape[-1])


def batch_is_supported(q: mx.array) -> bool:
    """`indexer_scores_batched_kernel` runs here for q [B, heads, d] (any B; chunks of MAX_BATCH), unless
    TESSERA_DECODE_BATCH_KERNELS=0 (kernels/cuda.py)."""
    return decode_batch_kernels.enabled() and is_supported(q)


def launch_shape(num_q: int, num_k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in MLX's convention — the grid counts threads, so MLX launches
    ceil(grid / threadgroup) blocks per axis: one block per KEYS_PER_BLOCK keys (x) × QUERIES_PER_BLOCK
    query rows (y), partial blocks at both ends included."""
    grid_x = -(-num_k // KEYS_PER_BLOCK) * (32 * WARPS)
    grid_y = -(-num_q // QUERIES_PER_BLOCK)
    return (grid_x, grid_y, 1), (32 * WARPS, 1, 1)


def indexer_scores_kernel(q: mx.array, head_weights: mx.array, keys: mx.array, visible: mx.array, scale: float) -> mx.array:
    """q: [T, heads, d], head_weights: [T, heads], keys: [N, d], visible: [T] -> scores [T, N] fp32."""
    num_q, heads, d = q.shape
    num_k = keys.shape[0]
    w = (head_weights.astype(mx.float32) * scale)  # fold the softmax scale into the head weights
    grid, threadgroup = launch_shape(num_q, num_k)
    (scores,) = _kernel()(
        inputs=[q.astype(mx.bfloat16), w, keys.astype(mx.bfloat16), visible.astype(mx.int32)],
        template=[("H", heads), ("D", d), ("KS", d // 16)],
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[(num_q, num_k)],
        output_dtypes=[mx.float32],
    )
    return scores
