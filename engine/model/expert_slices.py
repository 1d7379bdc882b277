"""Expert-sorted `gather_mm` kept inside MLX's CUDA grouped-GEMM offset range.

For M = 1 rows with sorted expert indices (the MoE's path), MLX's CUDA backend runs CUTLASS's
grouped GEMM; its setup kernel (`prepare_grouped_mm_data` in mlx/backend/cuda/gemms/
grouped_gemm_unaligned.cu, MLX 0.32) computes expert g's weight pointer as
`b_start + group * item_size * b_batch_stride` with all three factors 32-bit `int`. At V4 Flash's
MoE width in bf16 (256 experts of 4096 × 2048 = 16 MiB each) the product passes 2³¹ from expert
128 on: unless the compiler widened it, those experts read memory up to 2 GiB *below* the weights
(wrong numbers where that memory is mapped, an illegal memory access where it is not — the
suspected cause of the H200 crash in docs/BENCHMARKS.md "Issue 14"; the GPU check is
docs/bench/issue14_stage_sync_crash.py). FP4/FP8 weights (gather_qmm) take another path.

Where the offsets would overflow, the experts run as slices whose offsets stay below 2³¹ (a slice
is a view: MLX adds the view's offset to the base pointer in 64 bits). Rows are expert-sorted, so
each slice's rows are one contiguous run: with many rows (prefill) the run boundaries are read back
once per MoE call (one host sync, no extra compute); with few rows (decode) every slice takes every row,
the others clamped to the slice's edge expert and zeroed after (no sync, a few rows of extra work).
"""

from __future__ import annotations

import mlx.core as mx

GROUPED_OFFSET_LIMIT = 2**31  # bytes: the largest offset a 32-bit int product can hold, plus one
# At or below this many rows a call computes every slice on every row instead of syncing.
CLAMPED_MAX_ROWS = 256


def overflowing_expert(num_experts: int, expert_elements: int, itemsize: int, limit: int | None = None) -> int | None:
    """The first expert whose weight offset `expert * itemsize * expert_elements` does not fit the
    grouped GEMM's 32-bit product, or None when every expert's does."""
    limit = GROUPED_OFFSET_LIMIT if limit is None else limit
    first = -(-limit // (itemsize * expert_elements))  # smallest e with e · bytes ≥ limit
    return first if first < num_experts else None


def sorted_gather_mm(x: mx.array, w_t: mx.array, experts: mx.array, limit: int | None = None) -> mx.array:
    """x: [N, 1, in], w_t: [E, in, out] (a transposed view is fine), experts: [N] uint32 ascending
    -> [N, 1, out] = row n through expert experts[n], as `mx.gather_mm(..., sorted_indices=True)`."""
    per_slice = overflowing_expert(w_t.shape[0], w_t.shape[-2] * w_t.shape[-1], w_t.dtype.size, limit)
    if per_slice is None:
        return mx.gather_mm(x, w_t, rhs_indices=experts, sorted_indices=True)
    bounds = list(range(0, w_t.shape[0], per_slice)) + [w_t.shape[0]]
    if x.shape[0] <= CLAMPED_MAX_ROWS:
        return _clamped(x, w_t, experts, bounds)
    return _cut(x, w_t, experts, bounds)


def _clamped(x: mx.array, w_t: mx.array, experts: mx.array, bounds: list[int]) -> mx.array:
    """Every slice on every row; rows of other slices go to the slice's edge expert (indices stay
    sorted) and are zeroed. Each row's output comes from exactly one slice: the sum is exact."""
    out = None
    for e0, e1 in zip(bounds, bounds[1:]):
        local = (mx.clip(experts.astype(mx.int32), e0, e1 - 1) - e0).astype(mx.uint32)
        part = mx.gather_mm(x, w_t[e0:e1], rhs_indices=local, sorted_indices=True)
        mine = ((experts >= e0) & (experts < e1))[:, None, None]
        part = mx.where(mine, part, mx.zeros_like(part))
        out = part if out is None else out + part
    return out


# The MoE's three expert products (gate, up, down) share one sorted `experts` array: its row cuts
# are read back once, not three times (each read drains the device's queue).
_last_cuts: tuple[mx.array, list[int], list[int]] | None = None


def _row_cuts(experts: mx.array, bounds: list[int]) -> list[int]:
    """Sorted experts -> the row where each slice [bounds[i], bounds[i+1]) starts, and the end."""
    global _last_cuts
    if _last_cuts is None or _last_cuts[0] is not experts or _last_cuts[1] != bounds:
        _last_cuts = (experts, bounds, _read_cuts(experts, bounds))
    return _last_cuts[2]


def _read_cuts(experts: mx.array, bounds: list[int]) -> list[int]:
    edges = mx.array(bounds[1:-1], dtype=experts.dtype)
    return [0] + (experts[None, :] < edges[:, None]).sum(axis=1).tolist() + [experts.shape[0]]  # a host sync


def _cut(x: mx.array, w_t: mx.array, experts: mx.array, bounds: list[int]) -> mx.array:
    """Each slice on its own contiguous run of rows (where the sorted experts cross its bounds)."""
    cuts = _row_cuts(experts, bounds)
    parts = []
    for (e0, e1), (r0, r1) in zip(zip(bounds, bounds[1:]), zip(cuts, cuts[1:])):
        if r1 > r0:
            local = (experts[r0:r1].astype(mx.int32) - e0).astype(mx.uint32)
            parts.append(mx.gather_mm(x[r0:r1], w_t[e0:e1], rhs_indices=local, sorted_indices=True))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
