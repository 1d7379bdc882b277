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

import mlx.core as mx

from tessera.kernels.cuda import compiled_kernel, on_cuda

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

# Template constants: H (heads), D (head dim), KS = D / 16 (k-steps).
_SOURCE = r"""
  constexpr int TQ = 32, KPW = 32, NW = 8, PADDED = D + 8;
  constexpr int LOADS = (TQ * D / 8 + NW * 32 - 1) / (NW * 32);  // 16-byte loads per thread per head
  __shared__ __align__(16) __nv_bfloat16 q_tile[TQ * PADDED];
  __shared__ float w_tile[TQ * H];

  const int num_q = q_shape[0];
  const int num_k = k_shape[0];
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

def _kernel():
    return compiled_kernel("tessera_indexer_scores", ("q", "w", "k", "visible"), ("scores",), _SOURCE, _HEADER)


SHARED_MEMORY_LIMIT = 48 * 1024  # static __shared__ arrays beyond this do not compile


def shared_memory_bytes(heads: int, d: int) -> int:
    """The block's static shared memory: one head's padded bf16 query tile + every head weight."""
    return QUERIES_PER_BLOCK * (d + PAD) * 2 + QUERIES_PER_BLOCK * heads * 4


def shapes_fit(heads: int, d: int) -> bool:
    return d % 16 == 0 and 16 <= d <= 256 and 1 <= heads and shared_memory_bytes(heads, d) <= SHARED_MEMORY_LIMIT


def is_supported(q: mx.array, keys: mx.array) -> bool:
    return on_cuda() and shapes_fit(q.shape[1], q.shape[-1])


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
