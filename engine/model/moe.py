"""V4's MoE block: sqrt-softplus router (learned top-k with a correction bias, or a fixed
token-id → experts table in the first `hash_moe` layers), clamped-SwiGLU experts, one shared expert.

The routed experts run in one of two layouts, chosen by the step's (token, slot) pair count
(`uses_padded_layout`); both compute every pair's row through its expert, and `reference_routed_experts`
(a plain loop over experts) is what both must equal:

- gathered (decode, short steps): pairs sorted by expert, `gather_mm` / `gather_qmm` with one row per
  pair. No host sync; reads only the experts that are hit, which is what a decode step is bound by. On
  CUDA with mxfp4 experts, kernels/gather_qmv.py's gemv instead, and in a decode step (at most one pair
  per expert) without the sort (`_pairs_in_order`).
- padded (prefill): pairs gathered into an [E, capacity, D] block and run as one batched matmul per
  projection (bf16: a strided-batched cuBLAS gemm through `mx.matmul`; quantized: `gather_qmm` with
  `capacity` rows per expert, which MLX's CUDA backend runs as a tiled quantized gemm instead of one
  16-row tile per pair). Where the device's measured costs say it pays (`OVERFLOW_COST`), the pairs of
  busy experts beyond `capacity` go to a second, smaller block over those experts only (`plan_padded`).
  Padding rows hold a copy of some token's row and are never read back. The capacities are shapes, so
  the per-expert counts are copied to the host: one sync per MoE layer per step, only in steps this
  large, with the device kept busy around it (`OVERLAP_HOST_WORK`); the index tables follow from the
  counts and the sort (`padded_indices`), and the blocks' rows are weighted and summed per token in one
  step (`combine_rows`) — on CUDA one kernel each (kernels/moe_padded.py; docs/BENCHMARKS.md "Issue 14:
  MoE in prefill", "Issue 14, session 6" and "Issue 14, session 7: the padded MoE's index and combine kernels").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from tessera.engine.model.quantized import QuantizedWeight, Weight, linear
from tessera.kernels import moe_route
from tessera.kernels.cuda import on_cuda
from tessera.kernels.gather_qmv import gather_qmv_kernel
from tessera.kernels.gather_qmv import is_supported as gather_qmv_supported
from tessera.kernels.moe_padded import combine_rows, index_is_supported, moe_output, padded_indices_kernel
from tessera.kernels.moe_padded import weighted_sum as _weighted_sum  # [T, k, D] -> [T, D]: the combine's definition
from tessera.kernels.row_gather import take_rows
from tessera.kernels.shapeless import shapeless

# A step with at least this many (token, slot) pairs per routed expert on average runs the padded layout.
# Below it most of the padded block would be padding and every expert's weights would be read even when
# few are hit (decode); at 12 uniform routing's plan stays well inside PADDED_MAX_ROWS_PER_PAIR with
# CAPACITY_MULTIPLE = 16. A guess for the crossover, to be tuned with docs/bench/issue14_moe.py on the GPU.
PADDED_MIN_PAIRS_PER_EXPERT = 12
# The padded layout computes at most this many rows per pair (padding included); a step whose plan needs
# more (pathological routing) runs the gathered layout instead, so the MoE's scratch stays within this
# factor of the gathered layout's (engine/model/memory_plan.py counts it). 3, not 2: with 20 % of the
# experts drawn 4× as often (docs/bench/issue14_moe_parts.py's skew) one block needs exactly 3 rows a
# pair, and on the H200 it ran in 10.8 ms where the plan the bound of 2 forced (an overflow block) took
# 20.2 ms (docs/BENCHMARKS.md, "Session 6 on the H200 … the MoE's parts"); the cost is 1.5× the MoE's
# planned scratch (0.9 instead of 0.6 GB per 4,096-row V4 Flash chunk).
PADDED_MAX_ROWS_PER_PAIR = 3.0
# The padded capacities are multiples of this many rows (gemm tiles; fewer distinct shapes to compile).
CAPACITY_MULTIPLE = 16
# MLX's CUDA gather_qmm launches one grid z-slice per batch entry (qmm_sm80; CUDA allows 65,535), so
# the gathered layout's one-row-per-pair calls are split into pieces of at most this many pairs.
GATHER_QMM_MAX_BATCH = 65535
# Quantized experts in the padded layout's main block: dequantize this many experts at a time (to the
# activations' dtype, transiently: 32 V4 Flash experts are 1.6 GB in bf16) and run plain batched gemms,
# instead of gather_qmm on the packed weights. None = gather_qmm. Off until docs/bench/issue14_moe.py
# shows on the GPU that it pays (its "mxfp4_padded_dequantize32" setting).
DEQUANTIZE_EXPERT_GROUP: int | None = None


@dataclass(frozen=True)
class MoEWeights:
    router: mx.array  # [E, D]
    correction_bias: mx.array | None  # [E] (learned-routing layers)
    tid2eid: mx.array | None  # [vocab, k] (hash-routing layers)
    w1: Weight  # [E, I, D] gate
    w2: Weight  # [E, D, I] down
    w3: Weight  # [E, I, D] up
    shared_w1: Weight  # [I_shared, D]
    shared_w2: Weight  # [D, I_shared]
    shared_w3: Weight  # [I_shared, D]

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @cached_property
    def router_t(self) -> mx.array:
        """[D, E]: the router transposed, made once: a strided view of it, evaluated (as HyperWeights.fn_t32
        is), the very operand `router.T` gave the scores' product, without a Transpose node in every step's
        graph (one a layer). Made by `prime` before a compiled trace uses it."""
        router_t = self.router.T
        mx.eval(router_t)
        return router_t

    def prime(self) -> None:
        """Makes `router_t` now: it evaluates when made, never inside a compiled trace."""
        _ = self.router_t


def swiglu(x: mx.array, w1: Weight, w2: Weight, w3: Weight, limit: float) -> mx.array:
    """Clamped SwiGLU: gate clamped above, up clamped both sides (V4's swiglu_limit)."""
    return linear(_clamped_swiglu(linear(x, w1), linear(x, w3), limit), w2)


@shapeless
def _clamped_swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    """The SwiGLU activation with V4's clamps: gate clamped above, up both sides (one fused kernel)."""
    gate = mx.minimum(gate, limit)
    return gate * mx.sigmoid(gate) * mx.clip(up, -limit, limit)


def _cpu_float(x: mx.array) -> mx.array:
    """MLX's CPU GatherMM runs float32 only; bf16/fp16 operands are upcast there (exact)."""
    return x.astype(mx.float32) if x.dtype != mx.float32 and mx.default_device() == mx.cpu else x


# On CUDA the gathered layout's rows are passed *unsorted*: MLX then runs one gemv per row (`gather_mv`:
# float32 accumulation, 64-bit expert offsets). Sorted M = 1 rows would run CUTLASS's grouped GEMM, which
# inside the model gave wrong rows on the H200 (layer 0 of a 5-token prompt, 78 % relative; the same op
# alone was right), computes expert offsets in 32 bits (wrong past 2 GiB of experts) and was 3.5–5× slower
# at a decode step's pair counts (docs/BENCHMARKS.md, "Session 9 on the H200"). The CPU keeps the sorted
# form: there it is the same product, and the CPU's exactness tests were written against it.
def _gather_linear(x: mx.array, w: Weight, experts: mx.array) -> mx.array:
    """x: [..., M, in], experts: [...] -> [..., M, out]: batch entry n through expert experts[n]
    (experts ascend when M = 1: the gathered layout)."""
    if x.ndim == 3 and x.shape[1] == 1 and x.shape[0] and _takes_gather_qmv(x.dtype, x.shape[-1], w):
        return gather_qmv_kernel(x.reshape(x.shape[0], x.shape[-1]), w.values, w.scales, experts)[:, None, :]
    if isinstance(w, QuantizedWeight) and x.shape[0] > GATHER_QMM_MAX_BATCH:
        pieces = range(0, x.shape[0], GATHER_QMM_MAX_BATCH)
        return mx.concatenate([_gather_linear(x[s : s + GATHER_QMM_MAX_BATCH], w, experts[s : s + GATHER_QMM_MAX_BATCH]) for s in pieces])
    if isinstance(w, QuantizedWeight):
        return mx.gather_qmm(x, w.values, w.scales, w.biases, rhs_indices=experts, transpose=True,
                             group_size=w.group_size, bits=w.bits, mode=w.mode, sorted_indices=x.shape[-2] == 1)
    out = mx.gather_mm(_cpu_float(x), _cpu_float(w.swapaxes(-1, -2)), rhs_indices=experts,
                       sorted_indices=x.shape[-2] == 1 and not on_cuda())
    return out.astype(x.dtype)


def _takes_gather_qmv(dtype: mx.Dtype, in_features: int, w: Weight) -> bool:
    """Rows of this dtype and width, one per pair, through mxfp4 experts `w`, where kernels/gather_qmv.py's
    kernel runs (CUDA, the V4 Flash widths; TESSERA_GATHER_QMV_KERNEL=0 turns it off)."""
    return (isinstance(w, QuantizedWeight) and w.mode == "mxfp4" and w.bits == 4 and w.group_size == 32
            and w.biases is None and gather_qmv_supported(dtype, in_features, w.values))


def _batched_linear(x: mx.array, w: Weight) -> mx.array:
    """x: [E, C, in] -> [E, C, out]: block e through expert e (w: [E, out, in])."""
    if isinstance(w, QuantizedWeight):
        return _gather_linear(x, w, mx.arange(x.shape[0], dtype=mx.uint32))
    return (_cpu_float(x) @ _cpu_float(w.swapaxes(-1, -2))).astype(x.dtype)


def _expert_range(w: Weight, first: int, last: int) -> Weight:
    if isinstance(w, QuantizedWeight):
        biases = None if w.biases is None else w.biases[first:last]
        return QuantizedWeight(w.values[first:last], w.scales[first:last], biases, w.mode, w.bits, w.group_size)
    return w[first:last]


def _main_block(block: mx.array, w: MoEWeights, limit: float) -> mx.array:
    """block: [E, C, D] -> [E, C, D]: rows of block e through expert e. Quantized experts with
    DEQUANTIZE_EXPERT_GROUP set run a group of experts at a time on their dequantized weights."""
    group = DEQUANTIZE_EXPERT_GROUP if isinstance(w.w1, QuantizedWeight) else None
    if not group:
        hidden = _clamped_swiglu(_batched_linear(block, w.w1), _batched_linear(block, w.w3), limit)  # [E, C, I]
        return _batched_linear(hidden, w.w2)
    outs = []
    for first in range(0, block.shape[0], group):
        last = min(first + group, block.shape[0])
        w1, w2, w3 = (_expert_range(m, first, last).dequantize(block.dtype) for m in (w.w1, w.w2, w.w3))
        part = block[first:last]  # [G, C, D]
        hidden = _clamped_swiglu(_batched_linear(part, w1), _batched_linear(part, w3), limit)
        outs.append(_batched_linear(hidden, w2))
    return mx.concatenate(outs)


def uses_padded_layout(num_pairs: int, num_experts: int) -> bool:
    return num_pairs >= PADDED_MIN_PAIRS_PER_EXPERT * num_experts


def syncs_host(num_tokens: int, w: MoEWeights, top_k: int) -> bool:
    """Whether `moe` over `num_tokens` rows reads anything back from the device while it builds its
    graph: only the padded layout does (its counts). Without a read, the MoE is a pure function of its
    input's shape: a fixed-shape compiled trace can carry it (engine/model/compiled.py)."""
    return uses_padded_layout(num_tokens * top_k, w.num_experts)


def gathered_pairs(x: mx.array, flat: mx.array, order: mx.array, k: int, w: MoEWeights, limit: float) -> mx.array:
    """-> [P, D]: pair p's output at row p, computed with the pairs expert-sorted (order: argsort(flat)),
    or in pair order where kernels/gather_qmv.py's kernel runs every projection (`_pairs_in_order`)."""
    widths = ((w.w1, x.shape[-1]), (w.w3, x.shape[-1]), (w.w2, w.w2.shape[-1]))  # (weights, rows' width)
    few_pairs = 0 < flat.shape[0] <= w.num_experts  # a decode step: experts rarely shared (`_pairs_in_order`)
    if few_pairs and all(_takes_gather_qmv(x.dtype, width, m) for m, width in widths):
        return _pairs_in_order(x, flat, k, w, limit)
    return _pairs_sorted(x, flat, order, k, w, limit)


def _pairs_sorted(x: mx.array, flat: mx.array, order: mx.array, k: int, w: MoEWeights, limit: float) -> mx.array:
    """-> [P, D]: pair p's output at row p, the pairs run expert-sorted (order: argsort(flat))."""
    sorted_experts = flat[order].astype(mx.uint32)
    rows = x[order // k][:, None, :]  # [P, 1, D]
    hidden = _clamped_swiglu(_gather_linear(rows, w.w1, sorted_experts), _gather_linear(rows, w.w3, sorted_experts), limit)
    out = _gather_linear(hidden, w.w2, sorted_experts)[:, 0, :]  # [P, D] expert-sorted
    return out[mx.argsort(order)]


def _pairs_in_order(x: mx.array, flat: mx.array, k: int, w: MoEWeights, limit: float) -> mx.array:
    """x: [T, D], flat: [P = T·k] -> [P, D], pair p = (token p // k, slot p % k) through its expert, unsorted.
    The kernel's rows do not depend on their neighbours, so sorting the pairs would change no bit; skipping
    it saves a decode step's MoE two sorts, three gathers and a division per layer (kernels a GPU launches
    one by one), and the kernel reads a token's row for its k pairs itself (no repeat: no copy at all). Only for
    steps of at most one pair per expert: with more, pairs that share an expert read it in turn, and the sorted
    order puts them next to each other, where the second read finds the expert in the L2 cache."""
    experts = flat.astype(mx.uint32)
    gate = gather_qmv_kernel(x, w.w1.values, w.w1.scales, experts, rows_per_x=k)  # [P, I]: pair p reads token p // k's row
    up = gather_qmv_kernel(x, w.w3.values, w.w3.scales, experts, rows_per_x=k)
    return gather_qmv_kernel(_clamped_swiglu(gate, up, limit), w.w2.values, w.w2.scales, experts)  # [P, D]


@dataclass(frozen=True)
class PaddedPlan:
    """Where an expert's pairs go in the padded layout: its first `capacity` pairs into the main block
    [E, capacity, D] (one strided-batched gemm over every expert), the rest, for the `overflow` experts
    only, into a second block [len(overflow), overflow_capacity, D] (a gemm over those experts)."""
    capacity: int
    overflow: tuple[int, ...]  # experts with more than `capacity` pairs, ascending
    overflow_capacity: int

    def rows(self, num_experts: int) -> int:
        return num_experts * self.capacity + len(self.overflow) * self.overflow_capacity


@dataclass(frozen=True)
class OverflowCost:
    """What the overflow block costs, in rows of the main block: `fixed_rows` once (its own kernels,
    the overflow experts' weights read a second time) plus `per_row` for each of its rows."""
    fixed_rows: float
    per_row: float


# The overflow block's cost by (device, weights), for `plan_padded`; None: never use one (one block
# sized by the busiest expert, or the gathered layout when that block passes PADDED_MAX_ROWS_PER_PAIR).
# - CPU: guesses (plain weights' overflow block copies its experts' weights, so 2× per row).
# - CUDA: fitted to the H200's session-5 run (docs/BENCHMARKS.md "Session 5 on the H200 … the MoE in
#   prefill", raw h200-issue14-moe-session5-final.jsonl; 4,096 rows, 256 experts): the two one-block
#   points (32,768 and 73,728 rows) give a main row's marginal time, the two plans with an overflow block
#   (112 rows over 7 experts, 10,608 over 51) its fixed and per-row parts. bf16: 0.073 µs a main row,
#   overflow 1.66 ms fixed + 1.02 µs a row (its experts' weights are copied out) — so one block wins
#   unless it would pass the row bound. mxfp4: 0.79 µs a main row, overflow 7.2 ms + 1.02 µs a row.
#   Two points each: docs/bench/issue14_moe_parts.py ("new" vs "new_overflow") re-measures them.
OVERFLOW_COST: dict[tuple[str, str], OverflowCost | None] = {
    ("cpu", "plain"): OverflowCost(0.0, 2.0),
    ("cpu", "quantized"): OverflowCost(0.0, 1.0),
    ("cuda", "plain"): OverflowCost(22800.0, 14.0),
    ("cuda", "quantized"): OverflowCost(9100.0, 1.3),
}


def overflow_cost(w: MoEWeights) -> OverflowCost | None:
    """This device's overflow cost for these experts' weights (OVERFLOW_COST)."""
    return OVERFLOW_COST[("cuda" if on_cuda() else "cpu", "quantized" if isinstance(w.w1, QuantizedWeight) else "plain")]


def _round_up(n):
    """n (an int or an int array) rounded up to a multiple of CAPACITY_MULTIPLE."""
    return -(-n // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


def plan_padded(counts: np.ndarray, cost: OverflowCost | None, max_rows: float = float("inf")) -> PaddedPlan | None:
    """counts: [E] pairs per expert -> the plan of at most `max_rows` rows that costs the least, the
    overflow block costed by `cost` (None: one block only), or None when no plan fits. One capacity for
    all experts wastes most of the block when routing is skewed (a few busy experts set it); the overflow
    block takes their excess. Every candidate capacity is costed at once (numpy): this runs on the host
    between the counts' sync and the experts' graph."""
    one_block = max(CAPACITY_MULTIPLE, int(_round_up(int(counts.max()))))
    caps = np.arange(CAPACITY_MULTIPLE, one_block + 1, CAPACITY_MULTIPLE)  # [K] candidates
    excess = counts[None, :].astype(np.int64) - caps[:, None]  # [K, E]
    num_over = (excess > 0).sum(axis=1)  # [K]
    over_caps = _round_up(np.maximum(excess.max(axis=1), 0))  # [K]
    rows = len(counts) * caps + num_over * over_caps
    if cost is None:
        total = np.where(num_over > 0, np.inf, len(counts) * caps)
    else:
        total = len(counts) * caps + np.where(num_over > 0, cost.fixed_rows + cost.per_row * num_over * over_caps, 0.0)
    total = np.where(rows <= max_rows, total, np.inf)
    best = len(caps) - 1 - int(np.argmin(total[::-1]))  # a tie goes to the larger capacity: fewer overflow rows
    if not np.isfinite(total[best]):
        return None
    capacity = int(caps[best])
    return PaddedPlan(capacity, tuple(int(e) for e in np.flatnonzero(counts > capacity)), int(over_caps[best]))


@dataclass(frozen=True)
class PaddedTables:
    """Index tables of a padded plan, computed on the host from the per-expert counts alone; positions
    are in expert-sorted pair order (`order = argsort(experts)`)."""
    source: np.ndarray  # [rows] int32: the sorted position whose token each padded row reads (padding: 0)
    slot: np.ndarray  # [P] int32: the padded row of the pair at each sorted position


def padded_tables(counts: np.ndarray, plan: PaddedPlan) -> PaddedTables:
    """Expert e's pairs sit at sorted positions starts[e] … starts[e] + counts[e] − 1: the first
    `capacity` fill rows e·C …, the rest (overflow experts only) their overflow block's rows. So each
    expert's positions are at most two runs, each moved by one offset (numpy over 2·E runs, not a loop).
    Padding rows read sorted position 0 (any real token: their outputs are never read back, and a row of
    a batched gemm does not depend on the other rows, so what they hold changes no pair's result)."""
    num_experts, cap, over_cap = len(counts), plan.capacity, plan.overflow_capacity
    counts = counts.astype(np.int64)
    starts = np.cumsum(counts) - counts  # [E] first sorted position of each expert
    in_main = np.minimum(counts, cap)  # [E] run lengths: main block, then overflow block
    over_index = np.zeros(num_experts, dtype=np.int64)
    over_index[list(plan.overflow)] = np.arange(len(plan.overflow))
    main_offset = np.arange(num_experts) * cap - starts  # row = sorted position + offset
    over_offset = num_experts * cap + over_index * over_cap - (starts + cap)
    lengths = np.stack([in_main, counts - in_main], axis=1).reshape(-1)  # [2E]
    offsets = np.stack([main_offset, over_offset], axis=1).reshape(-1)
    num_pairs = int(counts.sum())
    slot = np.arange(num_pairs, dtype=np.int64) + np.repeat(offsets, lengths)  # [P]
    source = np.zeros(plan.rows(num_experts), dtype=np.int32)
    source[slot] = np.arange(num_pairs, dtype=np.int32)
    return PaddedTables(source, slot.astype(np.int32))


def expert_counts(flat: mx.array, num_experts: int) -> mx.array:
    """flat: [P] expert per pair -> [E] int32 pairs per expert: a compare-and-sum (no atomics; a [P, E]
    bool transient, 6 MB at 4,096 rows × top-6 × 256 experts; MLX sums bools to int32)."""
    return (flat[:, None] == mx.arange(num_experts, dtype=flat.dtype)[None, :]).sum(axis=0)


def padded_pairs(x: mx.array, flat: mx.array, order: mx.array, k: int, w: MoEWeights, limit: float,
                 counts: mx.array | None = None) -> mx.array:
    """-> [P, D]: pair p's output at row p, through the padded blocks (`PaddedPlan`); the gathered
    layout when no plan fits. The engine does not gather [P, D]: `_routed` combines the blocks' rows
    per token in one step (`combine_rows`); this form is the layout as LAYOUTS lists it."""
    blocks = _padded_blocks(x, flat, order, k, w, limit, counts)
    if blocks is None:  # no plan within the row bound (pathological routing)
        return gathered_pairs(x, flat, order, k, w, limit)
    out, slot = blocks
    return take_rows(out, slot)


def _padded_blocks(x: mx.array, flat: mx.array, order: mx.array, k: int, w: MoEWeights, limit: float,
                   counts: mx.array | None) -> tuple[mx.array, mx.array] | None:
    """-> (out [rows, D]: every padded row through its expert, slot [P]: pair p's row of out), or None
    when no plan fits the row bound. counts: the step's `expert_counts` when the caller already
    scheduled them (moe()). Copies the counts (E ints) to the host: the capacities are shapes. The one
    host sync of the layout; the index tables follow from the counts and the sort (`padded_indices`)."""
    num_pairs, dim = flat.shape[0], x.shape[-1]
    num_experts = w.num_experts
    counts = expert_counts(flat, num_experts) if counts is None else counts
    counts_np = np.array(counts)  # host sync
    plan = plan_padded(counts_np, overflow_cost(w), PADDED_MAX_ROWS_PER_PAIR * num_pairs)
    if plan is None:
        return None
    tokens, slot = padded_indices(order, flat, counts, counts_np, plan, k)
    rows = take_rows(x, tokens)  # [rows, D]: each padded row's token
    main_rows = num_experts * plan.capacity
    out = _main_block(rows[:main_rows].reshape(num_experts, plan.capacity, dim), w, limit).reshape(main_rows, dim)
    if plan.overflow:
        experts = mx.array(plan.overflow, dtype=mx.uint32)
        over = rows[main_rows:].reshape(len(plan.overflow), plan.overflow_capacity, dim)  # [E_o, C_o, D]
        out = mx.concatenate([out, _overflow_block(over, w, experts, limit).reshape(-1, dim)])
    return out, slot


def padded_indices(order: mx.array, flat: mx.array, counts: mx.array, counts_np: np.ndarray, plan: PaddedPlan,
                   k: int) -> tuple[mx.array, mx.array]:
    """-> (tokens [rows]: the token each padded row reads, slot [P]: pair p's padded row) for this plan
    (counts: [E] on the device, counts_np: the same on the host): one CUDA kernel where supported
    (kernels/moe_padded.py), else `padded_indices_reference`."""
    if index_is_supported(order, flat, counts):
        return padded_indices_kernel(order, flat, counts, plan.capacity, plan.overflow_capacity, plan.rows(len(counts_np)), k)
    return padded_indices_reference(order, counts_np, plan, k)


def padded_indices_reference(order: mx.array, counts: np.ndarray, plan: PaddedPlan, k: int) -> tuple[mx.array, mx.array]:
    """`padded_indices` from the host's tables (`padded_tables`): two uploads, then a gather, a division
    and one scatter of indices on the device."""
    tables = padded_tables(counts, plan)
    tokens = order[mx.array(tables.source)] // k
    slot = mx.zeros((order.shape[0],), dtype=mx.int32)
    slot[order] = mx.array(tables.slot)  # order is a permutation: one write each
    return tokens, slot


def _overflow_block(over: mx.array, w: MoEWeights, experts: mx.array, limit: float) -> mx.array:
    """over: [E_o, C_o, D] -> [E_o, C_o, D]: block i through expert experts[i]. Plain weights copy the
    overflow experts' weights out and run one batched gemm: MLX 0.32's CUDA gather_mm with several rows
    per expert runs a kernel that made a skewed 4,096-row step 9x slower than one padded block
    (docs/BENCHMARKS.md "Issue 14: MoE in prefill", H200). Quantized weights stay packed (gather_qmm)."""
    if isinstance(w.w1, QuantizedWeight):
        hidden = _clamped_swiglu(_gather_linear(over, w.w1, experts), _gather_linear(over, w.w3, experts), limit)
        return _gather_linear(hidden, w.w2, experts)
    w1, w2, w3 = (m[experts] for m in (w.w1, w.w2, w.w3))  # [E_o, out, in] copies
    hidden = _clamped_swiglu(_batched_linear(over, w1), _batched_linear(over, w3), limit)
    return _batched_linear(hidden, w2)


LAYOUTS = {"gathered": gathered_pairs, "padded": padded_pairs}


def routed_experts(x: mx.array, experts: mx.array, weights: mx.array, w: MoEWeights, limit: float,
                   layout: str | None = None) -> mx.array:
    """x: [T, D], experts/weights: [T, k] -> [T, D] float32: every (token, slot) pair through its expert,
    weighted and summed over the k slots. Pairs are sorted by expert on the device (`argsort`).
    layout: a LAYOUTS key, or None for the one `uses_padded_layout` picks (benchmarks force one)."""
    flat = experts.reshape(-1)  # [P = T·k]
    if layout is None:
        layout = "padded" if uses_padded_layout(flat.shape[0], w.num_experts) else "gathered"
    return _routed(x, flat, mx.argsort(flat), weights, w, limit, layout, None)


def _routed(x: mx.array, flat: mx.array, order: mx.array, weights: mx.array, w: MoEWeights, limit: float,
            layout: str, counts: mx.array | None) -> mx.array:
    """routed_experts with the sort (order: argsort(flat)) and, padded, the counts already built. The
    padded blocks' rows are weighted and summed per token in one step (`combine_rows`)."""
    num_tokens, k = weights.shape
    blocks = _padded_blocks(x, flat, order, k, w, limit, counts) if layout == "padded" else None
    if blocks is not None:
        return combine_rows(*blocks, weights)
    by_pair = (gathered_pairs if layout == "padded" else LAYOUTS[layout])(x, flat, order, k, w, limit)
    return _weighted_sum(by_pair.reshape(num_tokens, k, -1), weights)  # (token, slot) order


def reference_routed_experts(x: mx.array, experts: mx.array, weights: mx.array, w: MoEWeights, limit: float) -> mx.array:
    """The plain definition `routed_experts` must equal: a loop over experts, each run on its tokens
    with a dense matmul (quantized weights dequantized). Host-synced and slow; tests only."""
    num_tokens, k = experts.shape
    routed = mx.zeros((num_tokens, k, x.shape[-1]), dtype=mx.float32)
    experts_np = experts.tolist()
    for e in sorted({e for row in experts_np for e in row}):
        pairs = [(t, s) for t, row in enumerate(experts_np) for s, ee in enumerate(row) if ee == e]
        tok = mx.array([t for t, _ in pairs])
        slot = mx.array([s for _, s in pairs])
        w1, w2, w3 = (m.dequantize(x.dtype) if isinstance(m, QuantizedWeight) else m for m in (w.w1, w.w2, w.w3))
        out = swiglu(x[tok], w1[e], w2[e], w3[e], limit)  # [n, D]
        routed[tok, slot] = out.astype(mx.float32)
    return (routed * weights[:, :, None]).sum(axis=1)


def route(x: mx.array, token_ids: mx.array, w: MoEWeights, top_k: int, scaling: float) -> tuple[mx.array, mx.array]:
    """x: [T, D] -> (experts [T, k] uint32, weights [T, k]) from sqrt(softplus(logits)). uint32: what the top-k gives
    and the expert kernels take, so no cast kernel sits between them in a decode step (the hash table is held so).
    The math is kernels/moe_route.py's; on CUDA decode batches what follows the product is one kernel there (one
    graph node for seven, six in a hash layer: MLX's CUDA backend pays a host cost per node)."""
    logits = _router_logits(x, w.router_t)  # [T, E] float32
    if moe_route.is_supported(logits, top_k if w.tid2eid is None else w.tid2eid.shape[1]):
        if w.tid2eid is not None:
            return moe_route.hash_route_kernel(logits, w.tid2eid, token_ids, scaling)
        return moe_route.route_kernel(logits, w.correction_bias, top_k, scaling)
    scores = _router_scores(logits)  # [T, E]
    if w.tid2eid is not None:
        experts = w.tid2eid[token_ids]  # held in uint32 (weights.held_dtype)
    else:
        experts = mx.argpartition(_negated_biased(scores, w.correction_bias), kth=top_k - 1, axis=-1)[:, :top_k]
    return experts, _normalized(mx.take_along_axis(scores, experts, axis=-1), scaling)


# The router's steps, kernels/moe_route.py's functions compiled shapeless (kernels/shapeless.py), so the engine's
# path is its reference's ops; the slice of the top-k stays outside (a shapeless trace cannot carry a Slice). The
# product and the scores are two compiled functions, not one: the kernel takes the product, and the product (a
# Matmul, after a cast of bf16 rows) fuses with nothing either way, so the plain path builds the same nodes.
_router_logits = shapeless(moe_route.router_logits)  # x [T, D], router_t [D, E] (MoEWeights.router_t) -> [T, E] float32
_router_scores = shapeless(moe_route.scores)  # [T, E] float32 -> sqrt(softplus(logits))
_negated_biased = shapeless(moe_route.negated_biased)
_normalized = shapeless(sums_over=(0, -1))(moe_route.normalized)  # the k slots (top-1: plain, kernels/shapeless.py)


# moe() in a padded step lets the device run while the host works (mx.async_eval): the routing and
# everything before it while the host builds the shared expert's graph, the shared expert while the host
# reads the counts and plans the blocks, and the experts while the host builds the next layer's graph.
# Scheduling only: the values are the same either way (tests/test_moe.py). None: on a GPU only (on the
# CPU the "device" shares the host's cores, and the small CPU run in docs/BENCHMARKS.md "Issue 14,
# session 6" saw no gain); True / False force it (docs/bench/issue14_moe_parts.py compares the two).
OVERLAP_HOST_WORK: bool | None = None


def _overlaps_host_work() -> bool:
    return mx.default_device() == mx.gpu if OVERLAP_HOST_WORK is None else OVERLAP_HOST_WORK


def moe(x: mx.array, token_ids: mx.array, w: MoEWeights, top_k: int, scaling: float, limit: float) -> mx.array:
    """x: [T, D] -> [T, D]: routed experts (each run once on the tokens routed to it) + shared expert."""
    experts, weights = route(x, token_ids, w, top_k, scaling)
    flat = experts.reshape(-1)  # [P = T·k]
    if not uses_padded_layout(flat.shape[0], w.num_experts):
        return _gathered(x, flat, weights, w, limit).output(x)
    order = mx.argsort(flat)  # pair indices, expert-sorted
    counts = expert_counts(flat, w.num_experts)
    overlap = _overlaps_host_work()
    if overlap:
        mx.async_eval(counts, order, weights)
    shared = swiglu(x, w.shared_w1, w.shared_w2, w.shared_w3, limit)
    if overlap:
        mx.async_eval(shared)
    routed = _routed(x, flat, order, weights, w, limit, "padded", counts)
    out = _sum_in(routed, shared, x)
    if overlap:
        mx.async_eval(out)
    return out


@dataclass(frozen=True)
class RoutedPairs:
    """A gathered-layout MoE before its two sums: each (token, slot) pair's expert row, the router's weights and
    the shared expert's rows. `output` sums them as `moe` does; a CUDA decode step's expand takes them as they
    are instead, its one kernel making the sums (engine/model/hyper.py `expand_pairs`, kernels/hc_expand.py)."""

    rows: mx.array  # [T·k, D]: pair (t, j) at row t·k + j, in the block input's dtype
    weights: mx.array  # [T, k] float32
    shared: mx.array  # [T, D] in the block input's dtype

    def output(self, like: mx.array) -> mx.array:
        """-> [T, D] in `like`'s dtype (the block input's): `moe`'s result."""
        num_tokens, k = self.weights.shape
        by_pair = self.rows.reshape(num_tokens, k, -1)  # [T, k, D]: (token, slot) order
        return _sum_in(_weighted_sum(by_pair, self.weights), self.shared, like)


def moe_pairs(x: mx.array, token_ids: mx.array, w: MoEWeights, top_k: int, scaling: float, limit: float) -> RoutedPairs:
    """`moe` of a step that runs the gathered layout (`syncs_host` is false: decode), without its sums."""
    experts, weights = route(x, token_ids, w, top_k, scaling)
    return _gathered(x, experts.reshape(-1), weights, w, limit)


def _gathered(x: mx.array, flat: mx.array, weights: mx.array, w: MoEWeights, limit: float) -> RoutedPairs:
    """x: [T, D], flat: [P = T·k] experts, weights: [T, k] -> the pairs through the gathered layout and the shared expert."""
    shared = swiglu(x, w.shared_w1, w.shared_w2, w.shared_w3, limit)
    rows = gathered_pairs(x, flat, mx.argsort(flat), weights.shape[1], w, limit)  # [P, D]
    return RoutedPairs(rows, weights, shared)


_sum_in = shapeless(moe_output)  # routed [T, D] float32 + shared [T, D] in the block input's dtype
