"""Issue 14, session 6: where the padded MoE's time goes, piece by piece, and what the changes to it buy
(docs/BENCHMARKS.md "Issue 14, session 6: the MoE's non-gemm work"). No checkpoint: one full-width MoE
layer's experts are drawn with mx.random in the script.

    python docs/bench/issue14_moe_parts.py OUT.jsonl            # GPU: V4 Flash widths, 4,096 rows, bf16
    python docs/bench/issue14_moe_parts.py OUT.jsonl --small    # CPU: tiny shapes, float32, same code

For random and skewed routing (20 % of the experts drawn 4x as often), in one process, every setting
once forward and once backward (A B … B A), each round 2 warm-ups + --iters timed calls, medians:

- `matmul_moe_shapes`: the reference rate — the MoE's FLOP as dense gemms of its shapes.
- `weights_read`: one pass over the three expert matrices (a max-reduction): the floor of any layout
  that reads every expert, which every 4,096-row step does.
- `batched_gemm_only`: the padded layout's gemms + SwiGLU on a ready [E, C, D] block (C as the engine
  plans it): the ceiling of the padded layout's main block. `batched_gemm_fused_gate_up`: the same with
  gate and up as one [E, D, 2I] weight (one gemm instead of two; the loader does not store them so).
- `session5` / `session5_one_block`: the padded layout as merged in session 5 (a frozen copy below:
  device-side slot arithmetic, scatters of indices, a zero row appended to x; overflow block costed 2x a
  row / never).
- `new`: engine/model/moe.py now (index tables from the counts on the host, padding rows read a real
  token, the overflow block costed by this device's OVERFLOW_COST within PADDED_MAX_ROWS_PER_PAIR);
  `new_mlx_gather`: `new` with MLX's own gather for the two row gathers instead of kernels/row_gather.py;
  `new_one_block`: the same with one block whatever its size (no overflow block, no row bound);
  `new_overflow`: the same with the CPU's overflow cost (to re-measure what an overflow block costs here).
- `next` (session 7): engine/model/moe.py now — the index tables from one kernel (`indices`), the
  blocks' rows weighted and summed per token by one kernel (`combine`, replacing `gather_out` +
  `weighted_sum`; kernels/moe_padded.py); `next_no_combine_kernel` / `next_no_index_kernel`: one of the
  two switched off (its plain-MLX reference); `next_scheduled_as_moe`: `next` + the shared expert
  scheduled as moe() schedules a padded step (counts and sort started, the shared expert started before
  the host waits for the counts; whole calls only). The served chain adds `served_overlap_no_padded_kernels`
  (moe() with both kernels off) and a `padded_kernels_vs_not` check.

Each setting runs twice per round: `whole` (graph built and evaluated once, no syncs in between: what a
step pays; `host_ms` = the Python call until it returns, host sync included) and `parts` (an eval +
synchronize after each piece: where the time goes; the syncs add a little to each piece). Then moe() as
served (router included) through a chain of --chain layers, with and without OVERLAP_HOST_WORK (the
async_evals that let the device run while the host reads the counts and builds the next layer), and, if
the budget allows, the mxfp4 experts (new, new_one_block, new_overflow). `overflow_cost_fit` rows (bf16,
mxfp4) give the OVERFLOW_COST entry these timings imply (`fit`, beside the one in use, `now`), fitted from
new_one_block and new_overflow under both routings as engine/model/moe.py's comment on OVERFLOW_COST says. Every setting's output is
first checked against the engine's `routed_experts` (`check` rows: max |diff|; 0.0 expected on the CPU).
JSON lines; `summary` rows carry `fraction_of_matmul` = (MoE useful FLOP / time) / reference rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

# Run by path from a checkout: import this checkout as `tessera.*` (tests/support/source_tree.py links it).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()

from tessera.engine.model import moe as moe_mod  # noqa: E402
from tessera.engine.model.moe import MoEWeights, routed_experts, swiglu  # noqa: E402
from tessera.engine.model.quantized import QuantizedWeight, quantize  # noqa: E402
from tessera.kernels import moe_padded, row_gather  # noqa: E402
from tessera.kernels.moe_padded import combine_rows  # noqa: E402
from tessera.kernels.row_gather import take_rows  # noqa: E402

LIMIT, SCALING = 10.0, 1.5


@dataclass(frozen=True)
class Size:
    experts: int
    top_k: int
    dim: int
    inter: int
    rows: int


FULL = Size(256, 6, 4096, 2048, 4096)  # V4 Flash: hidden 4096, moe 2048, 256 experts top-6, chunk 4,096
SMALL = Size(16, 4, 128, 64, 256)


class Stages:
    """Per-piece times of one call: `mark(name, *arrays)` evaluates `arrays`, synchronizes and books the
    time since the last mark under `name` (host work included) when `synced`; otherwise does nothing."""

    def __init__(self, synced: bool) -> None:
        self.synced = synced
        self.times: dict[str, float] = {}
        self.last = time.perf_counter()

    def mark(self, name: str, *arrays: mx.array) -> None:
        if not self.synced:
            return
        if arrays:
            mx.eval(*arrays)
        mx.synchronize()
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.last = now


NO_STAGES = Stages(False)


def emit(out, **row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    out.write(line + "\n")
    out.flush()


def median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


# ---------------------------------------------------------------------------------------------------
# The session-5 padded layout, frozen (engine/model/moe.py at 51ce754), with its pieces marked.

def session5_plan(counts: np.ndarray, row_cost: float) -> moe_mod.PaddedPlan:
    best = None
    m = moe_mod.CAPACITY_MULTIPLE
    for capacity in range(m, -(-int(counts.max()) // m) * m + 1, m):
        over = np.flatnonzero(counts > capacity)
        over_cap = -(-int((counts[over] - capacity).max()) // m) * m if len(over) else 0
        cost = len(counts) * capacity + row_cost * len(over) * over_cap
        if best is None or cost <= best[0]:
            best = (cost, moe_mod.PaddedPlan(capacity, tuple(int(e) for e in over), over_cap))
    return best[1]


def session5_routed(x, experts, weights, w: MoEWeights, row_cost: float, st: Stages) -> mx.array:
    num_tokens, k = experts.shape
    dim, num_experts = x.shape[-1], w.num_experts
    flat = experts.reshape(-1)
    num_pairs = flat.shape[0]
    order = mx.argsort(flat)
    sorted_experts = flat[order]
    counts = mx.zeros((num_experts,), dtype=mx.int32).at[sorted_experts].add(1)
    st.mark("sort_counts", order, sorted_experts, counts)
    plan = session5_plan(np.array(counts), row_cost)  # host sync
    st.mark("sync_plan")
    starts = mx.cumsum(counts) - counts
    rank = mx.arange(num_pairs, dtype=mx.int32) - starts[sorted_experts]
    overflow_pos = np.zeros(num_experts, dtype=np.int32)
    overflow_pos[list(plan.overflow)] = np.arange(len(plan.overflow), dtype=np.int32)
    main_rows = num_experts * plan.capacity
    in_overflow = main_rows + mx.array(overflow_pos)[sorted_experts] * plan.overflow_capacity + rank - plan.capacity
    sorted_slots = mx.where(rank < plan.capacity, sorted_experts * plan.capacity + rank, in_overflow)
    slot = mx.zeros((num_pairs,), dtype=mx.int32)
    slot[order] = sorted_slots
    source = mx.full((plan.rows(num_experts),), num_tokens, dtype=mx.int32)
    source[slot] = mx.arange(num_pairs, dtype=mx.int32) // k
    st.mark("indices", slot, source)
    x_ext = mx.concatenate([x, mx.zeros((1, dim), dtype=x.dtype)])
    rows = x_ext[source]
    st.mark("gather_in", rows)
    y = expert_gemms(rows[:main_rows].reshape(num_experts, plan.capacity, dim), w, st).reshape(main_rows, dim)
    if plan.overflow:
        over = rows[main_rows:].reshape(len(plan.overflow), plan.overflow_capacity, dim)
        y = mx.concatenate([y, moe_mod._overflow_block(over, w, mx.array(plan.overflow, dtype=mx.uint32), LIMIT).reshape(-1, dim)])
        st.mark("overflow_block", y)
    by_pair = y[slot]
    st.mark("gather_out", by_pair)
    routed = moe_mod._weighted_sum(by_pair.reshape(num_tokens, k, dim), weights)
    st.mark("weighted_sum", routed)
    return routed


# ---------------------------------------------------------------------------------------------------
# Session 6's padded layout (engine/moe.py at 430b5ad: host tables, [P, D] gather out, weighted sum), pieces marked.

def new_routed(x, experts, weights, w: MoEWeights, cost, max_rows_per_pair: float, st: Stages) -> mx.array:
    num_tokens, k = experts.shape
    dim, num_experts = x.shape[-1], w.num_experts
    flat = experts.reshape(-1)
    num_pairs = flat.shape[0]
    order = mx.argsort(flat)
    counts = moe_mod.expert_counts(flat, num_experts)
    st.mark("sort_counts", order, counts)
    counts_np = np.array(counts)  # host sync
    plan = moe_mod.plan_padded(counts_np, cost, max_rows_per_pair * num_pairs)
    assert plan is not None, "no padded plan within the row bound: the engine would run the gathered layout"
    tables = moe_mod.padded_tables(counts_np, plan)
    st.mark("sync_plan")
    source = order[mx.array(tables.source)] // k
    slot = mx.zeros((num_pairs,), dtype=mx.int32)
    slot[order] = mx.array(tables.slot)
    st.mark("indices", source, slot)
    rows = take_rows(x, source)
    st.mark("gather_in", rows)
    main_rows = num_experts * plan.capacity
    y = expert_gemms(rows[:main_rows].reshape(num_experts, plan.capacity, dim), w, st).reshape(main_rows, dim)
    if plan.overflow:
        over = rows[main_rows:].reshape(len(plan.overflow), plan.overflow_capacity, dim)
        y = mx.concatenate([y, moe_mod._overflow_block(over, w, mx.array(plan.overflow, dtype=mx.uint32), LIMIT).reshape(-1, dim)])
        st.mark("overflow_block", y)
    by_pair = take_rows(y, slot)
    st.mark("gather_out", by_pair)
    routed = moe_mod._weighted_sum(by_pair.reshape(num_tokens, k, dim), weights)
    st.mark("weighted_sum", routed)
    return routed


# ---------------------------------------------------------------------------------------------------
# Session 7 (engine/model/moe.py now): the index tables from one kernel, the blocks' rows combined per
# token by one kernel (kernels/moe_padded.py; the plain-MLX references off CUDA or when switched off).

def next_routed(x, experts, weights, w: MoEWeights, st: Stages, counts_order=None) -> mx.array:
    """moe._routed's padded path with its pieces marked. counts_order: (counts, order) already
    scheduled by the caller (as moe() schedules them), else built here."""
    num_tokens, k = experts.shape
    dim, num_experts = x.shape[-1], w.num_experts
    flat = experts.reshape(-1)
    counts, order = counts_order or (moe_mod.expert_counts(flat, num_experts), mx.argsort(flat))
    st.mark("sort_counts", order, counts)
    counts_np = np.array(counts)  # host sync
    plan = moe_mod.plan_padded(counts_np, moe_mod.overflow_cost(w), moe_mod.PADDED_MAX_ROWS_PER_PAIR * flat.shape[0])
    assert plan is not None, "no padded plan within the row bound: the engine would run the gathered layout"
    st.mark("sync_plan")
    tokens, slot = moe_mod.padded_indices(order, flat, counts, counts_np, plan, k)
    st.mark("indices", tokens, slot)
    rows = take_rows(x, tokens)
    st.mark("gather_in", rows)
    main_rows = num_experts * plan.capacity
    y = expert_gemms(rows[:main_rows].reshape(num_experts, plan.capacity, dim), w, st).reshape(main_rows, dim)
    if plan.overflow:
        over = rows[main_rows:].reshape(len(plan.overflow), plan.overflow_capacity, dim)
        y = mx.concatenate([y, moe_mod._overflow_block(over, w, mx.array(plan.overflow, dtype=mx.uint32), LIMIT).reshape(-1, dim)])
        st.mark("overflow_block", y)
    routed = combine_rows(y, slot, weights)
    st.mark("combine", routed)
    return routed


def next_scheduled_as_moe(x, experts, weights, w: MoEWeights) -> Callable[[Stages], mx.array]:
    """`next` + the shared expert, scheduled as moe() schedules a padded step (OVERLAP_HOST_WORK): the
    counts and the sort started, then the shared expert started before the host waits for the counts."""
    def run(st: Stages) -> mx.array:
        flat = experts.reshape(-1)
        counts, order = moe_mod.expert_counts(flat, w.num_experts), mx.argsort(flat)
        mx.async_eval(counts, order)
        shared = swiglu(x, w.shared_w1, w.shared_w2, w.shared_w3, LIMIT)
        mx.async_eval(shared)
        return moe_mod._sum_in(next_routed(x, experts, weights, w, st, (counts, order)), shared, x)
    return run


def with_kernels(fn: Callable[[Stages], mx.array], combine: bool, index: bool) -> Callable[[Stages], mx.array]:
    """`fn` with kernels/moe_padded.py's combine / index kernels on or off (off: the plain-MLX references)."""
    def run(st: Stages) -> mx.array:
        saved = moe_padded.combine_kernel_enabled(), moe_padded.index_kernel_enabled()
        moe_padded.set_combine_kernel_enabled(combine)
        moe_padded.set_index_kernel_enabled(index)
        try:
            return fn(st)
        finally:
            moe_padded.set_combine_kernel_enabled(saved[0])
            moe_padded.set_index_kernel_enabled(saved[1])
    return run


def expert_gemms(block: mx.array, w: MoEWeights, st: Stages) -> mx.array:
    """moe._main_block (gather_qmm / batched gemm), its three products and the SwiGLU marked apart."""
    gate, up = moe_mod._batched_linear(block, w.w1), moe_mod._batched_linear(block, w.w3)
    st.mark("gemm_gate_up", gate, up)
    hidden = moe_mod._clamped_swiglu(gate, up, LIMIT)
    st.mark("swiglu", hidden)
    out = moe_mod._batched_linear(hidden, w.w2)
    st.mark("gemm_down", out)
    return out


def with_shared(routed_fn: Callable[[Stages], mx.array], x: mx.array, w: MoEWeights) -> Callable[[Stages], mx.array]:
    """The MoE block after routing: routed experts + the shared expert, summed as moe() sums them."""
    def run(st: Stages) -> mx.array:
        routed = routed_fn(st)
        shared = swiglu(x, w.shared_w1, w.shared_w2, w.shared_w3, LIMIT)
        st.mark("shared_expert", shared)
        out = moe_mod._sum_in(routed, shared, x)
        st.mark("sum", out)
        return out
    return run


# ---------------------------------------------------------------------------------------------------

def make_weights(s: Size, dtype: mx.Dtype) -> MoEWeights:
    def draw(shape):
        w = (mx.random.normal(shape, dtype=dtype) * 0.02).astype(dtype)
        mx.eval(w)
        return w
    return MoEWeights(
        router=draw((s.experts, s.dim)), correction_bias=mx.zeros((s.experts,)), tid2eid=None,
        w1=draw((s.experts, s.inter, s.dim)), w2=draw((s.experts, s.dim, s.inter)), w3=draw((s.experts, s.inter, s.dim)),
        shared_w1=draw((s.inter, s.dim)), shared_w2=draw((s.dim, s.inter)), shared_w3=draw((s.inter, s.dim)),
    )


def routing(s: Size, kind: str, seed: int) -> tuple[mx.array, mx.array]:
    """(experts [T, k] int32 distinct per token, weights [T, k]); "skewed": the first 20 % of the experts
    drawn with 4x the weight of the rest (Gumbel top-k), about half the pairs."""
    k1, k2 = mx.random.split(mx.random.key(seed))
    logits = mx.zeros((s.experts,))
    if kind == "skewed":
        logits = mx.where(mx.arange(s.experts) < max(1, s.experts // 5), mx.log(mx.array(4.0)), 0.0)
    gumbel = -mx.log(-mx.log(mx.random.uniform(shape=(s.rows, s.experts), key=k1) + 1e-20) + 1e-20)
    experts = mx.argpartition(-(logits + gumbel), kth=s.top_k - 1, axis=-1)[:, : s.top_k].astype(mx.int32)
    weights = mx.random.uniform(shape=(s.rows, s.top_k), key=k2) + 0.1
    weights = weights / weights.sum(axis=-1, keepdims=True) * SCALING
    mx.eval(experts, weights)
    return experts, weights


def time_whole(fn: Callable[[Stages], mx.array], iters: int, warmup: int) -> dict[str, list[float]]:
    for _ in range(warmup):
        mx.eval(fn(NO_STAGES))
        mx.synchronize()
    total, host = [], []
    for _ in range(iters):
        start = time.perf_counter()
        out = fn(NO_STAGES)
        built = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        total.append(time.perf_counter() - start)
        host.append(built - start)
    return {"total": total, "host": host}


def time_parts(fn: Callable[[Stages], mx.array], iters: int, warmup: int) -> dict[str, list[float]]:
    for _ in range(warmup):
        fn(Stages(True))
    parts: dict[str, list[float]] = {}
    for _ in range(iters):
        st = Stages(True)
        fn(st)
        for name, t in st.times.items():
            parts.setdefault(name, []).append(t)
    return parts


def run_rounds(out, label: dict, settings: dict[str, tuple[Callable, float, bool]], iters: int, warmup: int) -> dict:
    """settings: name -> (fn(Stages), useful FLOP, has_parts). A B … B A; per setting the medians."""
    order = list(settings) + list(settings)[::-1]
    whole: dict[str, list[list[float]]] = {n: [] for n in settings}
    host: dict[str, list[float]] = {n: [] for n in settings}
    parts: dict[str, dict[str, list[float]]] = {n: {} for n in settings}
    for name in order:
        fn, flop, has_parts = settings[name]
        t = time_whole(fn, iters, warmup)
        whole[name].append(t["total"])
        host[name] += t["host"]
        row = dict(what="round", **label, setting=name, round=len(whole[name]), ms_median=1e3 * median(t["total"]),
                   host_ms_median=1e3 * median(t["host"]))
        if has_parts:
            p = time_parts(fn, iters, warmup)
            for piece, v in p.items():
                parts[name].setdefault(piece, []).extend(v)
            row["parts_ms"] = {piece: 1e3 * median(v) for piece, v in p.items()}
        emit(out, **row)
    return {"whole": whole, "host": host, "parts": parts}


def summarize(out, label: dict, settings, res) -> None:
    rate = {n: settings[n][1] / median(sum(res["whole"][n], [])) / 1e12 for n in settings}
    ref = rate["matmul_moe_shapes"]
    for name in settings:
        parts = {p: 1e3 * median(v) for p, v in res["parts"][name].items()}
        emit(out, what="summary", **label, setting=name, ms_median=1e3 * median(sum(res["whole"][name], [])),
             ms_round_medians=[1e3 * median(r) for r in res["whole"][name]], host_ms_median=1e3 * median(res["host"][name]),
             tflops=rate[name], fraction_of_matmul=rate[name] / ref, matmul_ref_tflops=ref,
             parts_ms=parts or None, parts_sum_ms=sum(parts.values()) if parts else None)


def check(out, label: dict, name: str, got: mx.array, want: mx.array) -> None:
    diff = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    emit(out, what="check", **label, setting=name, max_abs_diff=diff, max_abs=float(mx.abs(want.astype(mx.float32)).max()))


def plan_rows(counts: np.ndarray, cost, bound: float) -> tuple[int, int]:
    """(main-block rows, overflow rows) of the plan the bench's layout runs for these counts."""
    plan = moe_mod.plan_padded(counts, cost, bound * counts.sum())
    main = len(counts) * plan.capacity
    return main, plan.rows(len(counts)) - main


def fit_overflow_cost(points: dict[str, dict]) -> dict:
    """The OVERFLOW_COST entry these timings imply, fitted as moe.py's comment describes: per routing,
    `one_ms` at `one_rows` (one block) and `over_ms` with `over_main_rows` + `over_rows` (an overflow
    block). The two one-block points give a main row's marginal time; each overflow plan, less its main
    block's predicted time, gives its overflow block's time; two such points give fixed + per row.
    None where the points cannot separate them (same rows, or an overflow plan without an overflow)."""
    r, k = points["random"], points["skewed"]
    if k["one_rows"] == r["one_rows"]:
        return {"fit": None, "why": "the one-block points have the same rows", **points}
    row_ms = (k["one_ms"] - r["one_ms"]) / (k["one_rows"] - r["one_rows"])
    block_ms = {n: p["over_ms"] - (p["one_ms"] - (p["one_rows"] - p["over_main_rows"]) * row_ms) for n, p in points.items()}
    if r["over_rows"] == 0 or k["over_rows"] == r["over_rows"] or row_ms <= 0:
        return {"fit": None, "why": "need two overflow plans of different sizes and a positive row time",
                "main_row_ms": row_ms, "overflow_block_ms": block_ms, **points}
    per_row_ms = (block_ms["skewed"] - block_ms["random"]) / (k["over_rows"] - r["over_rows"])
    fixed_ms = block_ms["random"] - per_row_ms * r["over_rows"]
    return {"fit": {"fixed_rows": fixed_ms / row_ms, "per_row": per_row_ms / row_ms}, "main_row_ms": row_ms,
            "overflow_block_ms": block_ms, "overflow_fixed_ms": fixed_ms, "overflow_row_ms": per_row_ms, **points}


def fit_point(experts: mx.array, s: Size, w: MoEWeights, one_ms: float, over_ms: float, over_cost, bound: float) -> dict:
    counts = np.array(moe_mod.expert_counts(experts.reshape(-1), s.experts))
    main, over = plan_rows(counts, over_cost, bound)
    return {"one_ms": one_ms, "one_rows": moe_mod.plan_padded(counts, None).rows(s.experts), "over_ms": over_ms,
            "over_main_rows": main, "over_rows": over}


def references(s: Size, w: MoEWeights, dtype, capacity: int) -> dict[str, tuple[Callable, float, bool]]:
    total = s.rows * s.top_k + s.rows
    a, h = mx.random.normal((total, s.dim), dtype=dtype), mx.random.normal((total, s.inter), dtype=dtype)
    b1, b3 = mx.random.normal((s.dim, s.inter), dtype=dtype), mx.random.normal((s.dim, s.inter), dtype=dtype)
    b2 = mx.random.normal((s.inter, s.dim), dtype=dtype)
    block = mx.random.normal((s.experts, capacity, s.dim), dtype=dtype)
    mx.eval(a, h, b1, b2, b3, block)
    flop = 3 * 2 * s.dim * s.inter * total
    read = lambda st: [mx.max(w.w1), mx.max(w.w2), mx.max(w.w3)]  # noqa: E731
    settings = {
        "matmul_moe_shapes": (lambda st: [a @ b1, a @ b3, h @ b2], flop, False),
        "weights_read": (read, flop, False),
        "batched_gemm_only": (lambda st: expert_gemms(block, w, st), flop, True),
    }
    if not isinstance(w.w1, QuantizedWeight):
        w13 = mx.concatenate([w.w1, w.w3], axis=1)  # [E, 2I, D]: gate and up as one weight (not what the loader keeps)
        mx.eval(w13)
        settings["batched_gemm_fused_gate_up"] = (lambda st: fused_gate_up_gemms(block, w13, w.w2, st), flop, True)
    return settings


def fused_gate_up_gemms(block: mx.array, w13: mx.array, w2: mx.array, st: Stages) -> mx.array:
    """expert_gemms with gate and up as one [E, C, D] @ [E, D, 2I] gemm: what storing them concatenated
    would buy (one launch, the block read once, N = 2I)."""
    inter = w13.shape[1] // 2
    both = moe_mod._batched_linear(block, w13)  # [E, C, 2I]
    st.mark("gemm_gate_up", both)
    hidden = moe_mod._clamped_swiglu(both[..., :inter], both[..., inter:], LIMIT)
    st.mark("swiglu", hidden)
    out = moe_mod._batched_linear(hidden, w2)
    st.mark("gemm_down", out)
    return out


def cpu_cost(w: MoEWeights):
    """The CPU's overflow cost for these weights: it takes an overflow block where the GPU's may not."""
    return moe_mod.OVERFLOW_COST[("cpu", "quantized" if isinstance(w.w1, QuantizedWeight) else "plain")]


def layouts(x, experts, weights, w: MoEWeights, flop: float) -> dict[str, tuple[Callable, float, bool]]:
    device_cost = moe_mod.overflow_cost(w)
    s5 = lambda cost: with_shared(lambda st: session5_routed(x, experts, weights, w, cost, st), x, w)  # noqa: E731
    bound = moe_mod.PADDED_MAX_ROWS_PER_PAIR
    new = lambda cost, bound: with_shared(lambda st: new_routed(x, experts, weights, w, cost, bound, st), x, w)  # noqa: E731
    return {
        "session5": (s5(2.0), flop, True),
        "session5_one_block": (s5(1e9), flop, True),
        "new": (new(device_cost, bound), flop, True),
        "new_mlx_gather": (mlx_gather(new(device_cost, bound)), flop, True),
        "new_one_block": (new(None, float("inf")), flop, True),
        "new_overflow": (new(cpu_cost(w), bound), flop, True),
        **next_layouts(x, experts, weights, w, flop),
    }


NEXT_LAYOUTS = ("next", "next_no_combine_kernel", "next_no_index_kernel", "next_scheduled_as_moe")


def next_layouts(x, experts, weights, w: MoEWeights, flop: float) -> dict[str, tuple[Callable, float, bool]]:
    """Session 7's arms: the engine now, each of its two kernels off, and the engine as moe() schedules it."""
    nxt = with_shared(lambda st: next_routed(x, experts, weights, w, st), x, w)
    return {
        "next": (nxt, flop, True),
        "next_no_combine_kernel": (with_kernels(nxt, combine=False, index=True), flop, True),
        "next_no_index_kernel": (with_kernels(nxt, combine=True, index=False), flop, True),
        "next_scheduled_as_moe": (next_scheduled_as_moe(x, experts, weights, w), flop, False),
    }


def mlx_gather(fn: Callable[[Stages], mx.array]) -> Callable[[Stages], mx.array]:
    """`fn` with MLX's own gather for the row gathers (kernels/row_gather.py switched off)."""
    def run(st: Stages) -> mx.array:
        saved = row_gather.kernel_enabled()
        row_gather.set_kernel_enabled(False)
        try:
            return fn(st)
        finally:
            row_gather.set_kernel_enabled(saved)
    return run


def check_layouts(out, label, settings, x, experts, weights, w) -> None:
    """Every layout's output against the engine's routed_experts (padded) + shared expert."""
    saved = moe_mod.PADDED_MAX_ROWS_PER_PAIR
    moe_mod.PADDED_MAX_ROWS_PER_PAIR = float("inf")  # the setting names the layout that runs
    try:
        want = moe_mod._sum_in(routed_experts(x, experts, weights, w, LIMIT, layout="padded"),
                               swiglu(x, w.shared_w1, w.shared_w2, w.shared_w3, LIMIT), x)
        for name in ("session5", "session5_one_block", "new", "new_mlx_gather", "new_one_block", "new_overflow", *NEXT_LAYOUTS):
            check(out, label, name, settings[name][0](NO_STAGES), want)
    finally:
        moe_mod.PADDED_MAX_ROWS_PER_PAIR = saved


def plan_row(s: Size, experts: mx.array, w: MoEWeights) -> dict:
    counts = np.array(moe_mod.expert_counts(experts.reshape(-1), s.experts))
    plan = moe_mod.plan_padded(counts, moe_mod.overflow_cost(w), moe_mod.PADDED_MAX_ROWS_PER_PAIR * counts.sum())
    one = moe_mod.plan_padded(counts, None)
    return {"max_count": int(counts.max()), "capacity": plan.capacity, "overflow_experts": len(plan.overflow),
            "overflow_capacity": plan.overflow_capacity, "rows_computed": plan.rows(s.experts), "pairs": int(counts.sum()),
            "one_block_capacity": one.capacity, "one_block_rows": one.rows(s.experts), "overflow_cost": str(moe_mod.overflow_cost(w))}


def served_chain(s: Size, w: MoEWeights, x: mx.array, layers: int) -> Callable[[Stages], mx.array]:
    """moe() as the model calls it (router included), `layers` times in a row, each layer's output
    RMS-normalized into the next's input: the host builds layer i+1 while the device may still run i."""
    ids = mx.zeros((s.rows,), dtype=mx.int32)

    def run(st: Stages) -> mx.array:
        h = x
        for _ in range(layers):
            y = moe_mod.moe(h, ids, w, s.top_k, SCALING, LIMIT)
            h = (y * mx.rsqrt(mx.mean(mx.square(y.astype(mx.float32)), axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)
        return h
    return run


def overlap_setting(fn: Callable[[Stages], mx.array], overlap: bool) -> Callable[[Stages], mx.array]:
    def run(st: Stages) -> mx.array:
        saved = moe_mod.OVERLAP_HOST_WORK
        moe_mod.OVERLAP_HOST_WORK = overlap
        try:
            return fn(st)
        finally:
            moe_mod.OVERLAP_HOST_WORK = saved
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="JSON lines output path")
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the same code)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chain", type=int, default=4, help="layers in the moe()-as-served chain")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--budget-s", type=float, default=110.0, help="skip the optional mxfp4 part after this many seconds")
    args = p.parse_args()
    s = SMALL if args.small else FULL
    on_gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if on_gpu else "float32"))
    t0 = time.perf_counter()
    with open(args.out, "w") as out:
        emit(out, what="setup", size="small" if args.small else "full", device=str(mx.default_device()), dtype=str(dtype),
             mlx=mx.__version__, iters=args.iters, warmup=args.warmup, **s.__dict__)
        mx.random.seed(0)
        w = make_weights(s, dtype)
        x = mx.random.normal((s.rows, s.dim), dtype=dtype)
        mx.eval(x)
        flop = 3 * 2 * s.dim * s.inter * (s.rows * s.top_k + s.rows)
        emit(out, what="weights_ready", seconds=time.perf_counter() - t0)
        points = {}
        for kind in ("random", "skewed"):
            experts, weights = routing(s, kind, seed=1)
            label = {"routing": kind}
            plan = plan_row(s, experts, w)
            emit(out, what="plan", **label, **plan)
            settings = {**references(s, w, dtype, plan["capacity"]), **layouts(x, experts, weights, w, flop)}
            check_layouts(out, label, settings, x, experts, weights, w)
            res = run_rounds(out, label, settings, args.iters, args.warmup)
            summarize(out, label, settings, res)
            ms = {n: 1e3 * median(sum(res["whole"][n], [])) for n in ("new_one_block", "new_overflow")}
            points[kind] = fit_point(experts, s, w, ms["new_one_block"], ms["new_overflow"], cpu_cost(w), moe_mod.PADDED_MAX_ROWS_PER_PAIR)
            emit(out, what="elapsed", seconds=time.perf_counter() - t0)
        emit(out, what="overflow_cost_fit", experts="plain", now=str(moe_mod.overflow_cost(w)), **fit_overflow_cost(points))
        served(out, s, w, x, flop, args)
        emit(out, what="elapsed", seconds=time.perf_counter() - t0)
        if time.perf_counter() - t0 > args.budget_s:
            emit(out, what="skipped_optional_part", part="mxfp4", elapsed_s=time.perf_counter() - t0)
        else:
            quantized_overflow(out, s, w, x, flop, args)
        emit(out, what="done", seconds=time.perf_counter() - t0)


def served(out, s: Size, w: MoEWeights, x: mx.array, flop: float, args) -> None:
    label = {"routing": "router", "chain": args.chain}
    chain = served_chain(s, w, x, args.chain)
    on, off = overlap_setting(chain, True), overlap_setting(chain, False)
    emit(out, what="check", **label, setting="overlap_vs_not", max_abs_diff=float(mx.abs(on(NO_STAGES).astype(mx.float32) - off(NO_STAGES).astype(mx.float32)).max()))
    plain = with_kernels(on, combine=False, index=False)  # kernels/moe_padded.py's references
    emit(out, what="check", **label, setting="padded_kernels_vs_not", max_abs_diff=float(mx.abs(on(NO_STAGES).astype(mx.float32) - plain(NO_STAGES).astype(mx.float32)).max()))
    settings = {"served_overlap": (on, flop * args.chain, False), "served_no_overlap": (off, flop * args.chain, False),
                "served_overlap_no_padded_kernels": (plain, flop * args.chain, False)}
    res = run_rounds(out, label, settings, args.iters, args.warmup)
    for name in settings:
        t = median(sum(res["whole"][name], []))
        emit(out, what="summary_served", **label, setting=name, ms_median=1e3 * t, ms_per_layer=1e3 * t / args.chain,
             host_ms_median=1e3 * median(res["host"][name]), tflops=settings[name][1] / t / 1e12)


def quantized_overflow(out, s: Size, w: MoEWeights, x: mx.array, flop: float, args) -> None:
    """mxfp4 experts: the padded layout with the overflow block as costed for this device vs one block,
    to check OVERFLOW_COST's quantized entry (whole calls only)."""
    q = {n: quantize(getattr(w, n), "mxfp4", 32) for n in ("w1", "w2", "w3")}
    mx.eval([a for v in q.values() for a in v.arrays()])
    wq = replace(w, **q)
    points = {}
    for kind in ("random", "skewed"):
        experts, weights = routing(s, kind, seed=1)
        label = {"routing": kind, "experts": "mxfp4"}
        emit(out, what="plan", **label, **plan_row(s, experts, wq))
        new = lambda cost, bound: with_shared(lambda st: new_routed(x, experts, weights, wq, cost, bound, st), x, wq)  # noqa: E731
        bound = moe_mod.PADDED_MAX_ROWS_PER_PAIR
        settings = {"new": (new(moe_mod.overflow_cost(wq), bound), flop, False),
                    "new_one_block": (new(None, float("inf")), flop, False),
                    "new_overflow": (new(cpu_cost(wq), bound), flop, False),
                    "next": (with_shared(lambda st: next_routed(x, experts, weights, wq, st), x, wq), flop, False)}
        res = run_rounds(out, label, settings, max(3, args.iters // 2), 1)
        ms = {}
        for name in settings:
            t = median(sum(res["whole"][name], []))
            ms[name] = 1e3 * t
            emit(out, what="summary_mxfp4", **label, setting=name, ms_median=1e3 * t, tflops=flop / t / 1e12)
        points[kind] = fit_point(experts, s, wq, ms["new_one_block"], ms["new_overflow"], cpu_cost(wq), bound)
    emit(out, what="overflow_cost_fit", experts="mxfp4", now=str(moe_mod.overflow_cost(wq)), **fit_overflow_cost(points))


if __name__ == "__main__":
    main()
