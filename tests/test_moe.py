"""The routed experts' two layouts (engine/model/moe.py) against the plain per-expert loop.

Gathered (one row per pair, decode) and padded ([E, capacity, D] batched matmuls, prefill) must both
equal `reference_routed_experts`; in float32 with MLX's bundled BLAS bit for bit (a row's product does
not depend on the other rows of its matmul there), so a prefill chunk that runs padded and a decode step
that runs gathered give a token the same result."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import moe as moe_mod
from tessera.engine.model.moe import (
    MoEWeights, OverflowCost, PaddedPlan, moe, padded_tables, plan_padded, reference_routed_experts, route, routed_experts,
)
from tessera.engine.model.quantized import quantize
from tests.equivalence.row_invariant_blas import row_invariant_blas
from tests.support.graph_nodes import primitive_kinds

EXPERTS, DIM, INTER, TOP_K, LIMIT = 8, 64, 32, 2, 7.0


def _weights(dtype=mx.float32, seed: int = 0) -> MoEWeights:
    mx.random.seed(seed)
    n = mx.random.normal
    return MoEWeights(
        router=n((EXPERTS, DIM)), correction_bias=n((EXPERTS,)), tid2eid=None,
        w1=(n((EXPERTS, INTER, DIM)) * 0.2).astype(dtype), w2=(n((EXPERTS, DIM, INTER)) * 0.2).astype(dtype),
        w3=(n((EXPERTS, INTER, DIM)) * 0.2).astype(dtype),
        shared_w1=n((INTER, DIM)) * 0.2, shared_w2=n((DIM, INTER)) * 0.2, shared_w3=n((INTER, DIM)) * 0.2,
    )


def _skewed_experts(tokens: int, seed: int = 1) -> mx.array:
    """[T, k]: expert 3 in every token's first slot (its count is T, the others' ~T/7), expert 6 never."""
    rng = np.random.default_rng(seed)
    others = [e for e in range(EXPERTS) if e not in (3, 6)]
    second = rng.choice(others, size=tokens)
    return mx.array(np.stack([np.full(tokens, 3), second], axis=1).astype(np.int32))


def _run(layout: str, x, experts, weights, w, monkeypatch) -> mx.array:
    """Through the layout the pair count picks, with the threshold moved so that it picks `layout`."""
    threshold = 0 if layout == "padded" else 10**9
    monkeypatch.setattr(moe_mod, "PADDED_MIN_PAIRS_PER_EXPERT", threshold)
    out = routed_experts(x, experts, weights, w, LIMIT)
    assert np.array_equal(np.array(out), np.array(routed_experts(x, experts, weights, w, LIMIT, layout=layout)))
    return out


@row_invariant_blas
@pytest.mark.parametrize("layout", ["gathered", "padded"])
@pytest.mark.parametrize("routing", ["learned", "skewed"])
def test_layout_equals_per_expert_loop_bit_for_bit(layout, routing, monkeypatch):
    w = _weights()
    mx.random.seed(5)
    x = mx.random.normal((97, DIM))
    experts, weights = route(x, None, w, TOP_K, 1.5)
    if routing == "skewed":
        experts = _skewed_experts(97)
    out = _run(layout, x, experts, weights, w, monkeypatch)
    ref = reference_routed_experts(x, experts, weights, w, LIMIT)
    assert float(mx.abs(ref).max()) > 0.1  # the experts did something
    assert np.array_equal(np.array(out), np.array(ref))


@row_invariant_blas
def test_gathered_layout_on_cuda_passes_unsorted_rows_and_computes_the_same(monkeypatch):
    """On CUDA the gathered layout must not hand MLX sorted M = 1 rows (its grouped GEMM gave wrong rows
    inside the model on the H200; the comment at moe._gather_linear). The unsorted form computes the
    same pairs: here both run on the CPU."""
    w = _weights()
    mx.random.seed(7)
    x = mx.random.normal((9, DIM))
    experts, weights = route(x, None, w, TOP_K, 1.5)
    on_cpu = routed_experts(x, experts, weights, w, LIMIT, layout="gathered")
    real, sorted_flags = mx.gather_mm, []
    monkeypatch.setattr(moe_mod, "on_cuda", lambda: True)
    monkeypatch.setattr(moe_mod.mx, "gather_mm", lambda *a, **k: (sorted_flags.append(k["sorted_indices"]), real(*a, **k))[1])
    as_on_cuda = routed_experts(x, experts, weights, w, LIMIT, layout="gathered")
    assert sorted_flags == [False, False, False]  # gate, up, down
    assert np.array_equal(np.array(as_on_cuda), np.array(on_cpu))


@row_invariant_blas
@pytest.mark.parametrize("layout", ["gathered", "padded"])
def test_a_top1_moe_runs_and_equals_the_per_expert_loop(layout, monkeypatch):
    """One expert per token (a valid config): every sum over the k slots has one term. MLX 0.32.4's
    shapeless compile segfaulted on exactly that (the routing weights' sum and the weighted sum)."""
    w = _weights()
    mx.random.seed(6)
    x = mx.random.normal((97, DIM))
    experts, weights = route(x, None, w, 1, 1.5)
    assert experts.shape == (97, 1) and np.allclose(np.array(weights), 1.5)
    out = _run(layout, x, experts, weights, w, monkeypatch)
    assert np.array_equal(np.array(out), np.array(reference_routed_experts(x, experts, weights, w, LIMIT)))
    block = moe(x, mx.zeros((97,), dtype=mx.int32), w, 1, 1.5, LIMIT)  # the whole block, shared expert included
    assert block.shape == x.shape and bool(mx.isfinite(block).all())


@row_invariant_blas  # bit equality of an M = 1 and an M = C gemm holds for the row-invariant BLAS only
def test_bf16_layouts_agree(monkeypatch):
    w = _weights(mx.bfloat16)
    mx.random.seed(6)
    x = mx.random.normal((64, DIM)).astype(mx.bfloat16)
    experts, weights = route(x, None, w, TOP_K, 1.5)
    gathered = _run("gathered", x, experts, weights, w, monkeypatch)
    padded = _run("padded", x, experts, weights, w, monkeypatch)
    ref = reference_routed_experts(x, experts, weights, w, LIMIT)
    assert np.array_equal(np.array(gathered), np.array(padded))
    np.testing.assert_allclose(np.array(padded), np.array(ref), atol=0.05 * float(mx.abs(ref).max()))


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
def test_quantized_layouts_match_dequantized_loop(mode, monkeypatch):
    base = _weights()
    q = {name: quantize(getattr(base, name), mode, 32) for name in ("w1", "w2", "w3")}
    w = dataclasses.replace(base, **q)
    mx.random.seed(7)
    x = mx.random.normal((80, DIM))
    experts = _skewed_experts(80)
    _, weights = route(x, None, w, TOP_K, 1.5)
    ref = np.array(reference_routed_experts(x, experts, weights, w, LIMIT))
    scale = float(np.abs(ref).max())
    for layout in ("gathered", "padded"):
        out = np.array(_run(layout, x, experts, weights, w, monkeypatch))
        # quantized matmuls vs the dequantized loop: same weights, different summation order
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * scale, err_msg=layout)


def test_gathered_quantized_pairs_split_into_pieces_give_the_same_result(monkeypatch):
    base = _weights()
    w = dataclasses.replace(base, **{n: quantize(getattr(base, n), "mxfp4", 32) for n in ("w1", "w2", "w3")})
    mx.random.seed(10)
    x = mx.random.normal((40, DIM))
    experts, weights = route(x, None, w, TOP_K, 1.5)
    whole = routed_experts(x, experts, weights, w, LIMIT, layout="gathered")
    monkeypatch.setattr(moe_mod, "GATHER_QMM_MAX_BATCH", 7)  # 80 pairs -> 12 pieces
    pieces = routed_experts(x, experts, weights, w, LIMIT, layout="gathered")
    assert np.array_equal(np.array(whole), np.array(pieces))


def test_gathered_mxfp4_pairs_go_to_the_gather_qmv_kernel_where_it_runs(monkeypatch, tmp_path):
    """The wiring of kernels/gather_qmv.py into the gathered layout, on the CPU: with the kernel's checks
    passing (switch on, a CUDA device pretended) every projection of the pairs goes to it (gate and up on the
    tokens' rows, read k times each: no repeat; down on the hidden rows, one a pair),
    in pair order (unsorted), and the result has the sorted path's bits (the kernel stood in by its
    reference); with at most one pair per expert the graph holds no sort and no row gather, which the sorted
    path (more pairs, or no kernel) needs."""
    from tessera.kernels import gather_qmv

    base = _weights()
    w = dataclasses.replace(base, **{n: quantize(getattr(base, n), "mxfp4", 32) for n in ("w1", "w2", "w3")})
    mx.random.seed(12)
    x = mx.random.normal((4, DIM))  # 8 pairs, one per expert on average: a decode step's
    experts, weights = route(x, None, w, TOP_K, 1.5)
    want = routed_experts(x, experts, weights, w, LIMIT, layout="gathered")
    calls = []

    def stand_in(rows, values, scales, pair_experts, rows_per_x=1):
        calls.append((rows.shape, rows_per_x))
        return gather_qmv.gather_qmv_reference(rows, values, scales, pair_experts, rows_per_x)

    monkeypatch.setattr(gather_qmv, "on_cuda", lambda: True)
    monkeypatch.setattr(gather_qmv, "fits", lambda k, n: True)  # this test's widths are small
    monkeypatch.setattr(moe_mod, "gather_qmv_kernel", stand_in)
    got = routed_experts(x, experts, weights, w, LIMIT, layout="gathered")  # the switch is on by default
    # w1 and w3 read each token's row for its TOP_K pairs (no repeat), then w2 the hidden rows, one a pair
    assert calls == [((4, DIM), TOP_K), ((4, DIM), TOP_K), ((8, w.w2.shape[-1]), 1)]
    assert np.array_equal(np.array(got), np.array(want))
    kinds = _primitive_kinds(routed_experts(x, experts, weights, w, LIMIT, layout="gathered"), tmp_path)
    assert "GatherQMM" in kinds and not {"ArgSort", "Gather"} & kinds  # the stand-in ran; nothing sorted
    more = mx.random.normal((16, DIM))  # 32 pairs over 8 experts: sorted, so pairs of an expert run together
    assert {"ArgSort", "Gather"} <= _primitive_kinds(routed_experts(more, *route(more, None, w, TOP_K, 1.5), w, LIMIT, layout="gathered"), tmp_path)
    monkeypatch.setattr(gather_qmv, "fits", lambda k, n: False)  # where the kernel does not run: sorted
    assert {"ArgSort", "Gather"} <= _primitive_kinds(routed_experts(x, experts, weights, w, LIMIT, layout="gathered"), tmp_path)


def _primitive_kinds(out: mx.array, tmp_path) -> set[str]:
    """The primitive kinds in the graph that makes `out`."""
    return set(primitive_kinds(out, tmp_path / "graph.dot"))


def test_dequantized_expert_groups_match_the_loop(monkeypatch):
    base = _weights()
    w = dataclasses.replace(base, **{n: quantize(getattr(base, n), "mxfp4", 32) for n in ("w1", "w2", "w3")})
    mx.random.seed(8)
    x = mx.random.normal((80, DIM))
    experts = _skewed_experts(80)
    _, weights = route(x, None, w, TOP_K, 1.5)
    ref = reference_routed_experts(x, experts, weights, w, LIMIT)  # the loop runs on dequantized weights too
    monkeypatch.setattr(moe_mod, "DEQUANTIZE_EXPERT_GROUP", 3)  # groups 0-2, 3-5, 6-7
    out = routed_experts(x, experts, weights, w, LIMIT, layout="padded")
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=0, atol=1e-6 * float(mx.abs(ref).max()))


def _counts(flat: np.ndarray) -> np.ndarray:
    return np.bincount(flat, minlength=EXPERTS)


def test_padded_tables_are_a_packing_of_each_experts_pairs():
    experts_np = np.array(_skewed_experts(50)).reshape(-1)  # expert 3: 50 pairs, the others ~8, expert 6 none
    order = np.argsort(experts_np, kind="stable")
    counts = _counts(experts_np)
    plan = plan_padded(counts, OverflowCost(0.0, 1.0))
    assert plan.capacity == 16 and plan.overflow == (3,) and plan.overflow_capacity == 48  # 34 more, rounded up
    t = padded_tables(counts, plan)
    assert len(t.source) == plan.rows(EXPERTS) and len(t.slot) == len(experts_np)
    assert len(set(t.slot.tolist())) == len(t.slot) and t.slot.max() < plan.rows(EXPERTS)  # one row per pair
    assert np.array_equal(t.source[t.slot], np.arange(len(t.slot)))  # a pair's row reads that pair's token
    slot = np.empty_like(t.slot)
    slot[order] = t.slot  # pair order, as padded_pairs scatters it
    main = slot < EXPERTS * plan.capacity
    assert np.array_equal(slot[main] // plan.capacity, experts_np[main])  # each pair in its expert's block
    for e in range(EXPERTS):  # each expert's pairs fill its first rows, then its overflow rows
        rows = np.sort(slot[experts_np == e])
        n = len(rows)
        first = list(range(e * plan.capacity, e * plan.capacity + min(n, plan.capacity)))
        rest = list(range(EXPERTS * plan.capacity, EXPERTS * plan.capacity + n - len(first)))
        assert rows.tolist() == first + rest


def test_plan_padded_takes_the_fewest_rows():
    uniform = np.array([90, 96, 100, 101])
    assert plan_padded(uniform, OverflowCost(0.0, 2.0)) == PaddedPlan(112, (), 0)  # one block, the busiest expert rounded up
    skewed = np.array([240, 60, 60, 60, 60, 60, 60, 60])
    plan = plan_padded(skewed, OverflowCost(0.0, 2.0))
    assert plan == PaddedPlan(64, (0,), 176)  # 8·64 + 2·176 = 864 row-costs < 8·240 = 1920
    assert plan.rows(8) == 8 * 64 + 176
    assert plan_padded(skewed, OverflowCost(0.0, 100.0)) == PaddedPlan(240, (), 0)  # a costly overflow block is avoided
    assert plan_padded(skewed, OverflowCost(1500.0, 2.0)) == PaddedPlan(240, (), 0)  # 864 + 1500 > 1920: its fixed cost too
    assert plan_padded(skewed, None) == PaddedPlan(240, (), 0)  # no overflow block on this device


def test_plan_padded_stays_within_the_row_bound():
    skewed = np.array([240, 60, 60, 60, 60, 60, 60, 60])
    costly = OverflowCost(5000.0, 14.0)  # one block (1,920 rows) is the cheapest without a bound
    assert plan_padded(skewed, costly) == PaddedPlan(240, (), 0)
    bounded = plan_padded(skewed, costly, max_rows=1000)  # then the cheapest plan of at most 1,000 rows
    assert bounded == PaddedPlan(96, (0,), 144) and bounded.rows(8) == 912
    assert plan_padded(skewed, costly, max_rows=687) is None  # 8·64 + 176 = 688 rows is the fewest any plan needs
    assert plan_padded(skewed, costly, max_rows=688) == PaddedPlan(64, (0,), 176)
    assert plan_padded(skewed, None, max_rows=1000) is None  # one block only, and it does not fit


def _plan_by_loop(counts: np.ndarray, cost: OverflowCost, max_rows: float) -> PaddedPlan | None:
    """plan_padded's definition: try every capacity, keep the cheapest that fits (ties: the larger)."""
    best = None
    for capacity in range(16, -(-int(counts.max()) // 16) * 16 + 1, 16):
        over = np.flatnonzero(counts > capacity)
        over_cap = -(-int((counts[over] - capacity).max()) // 16) * 16 if len(over) else 0
        total = len(counts) * capacity + (cost.fixed_rows + cost.per_row * len(over) * over_cap if len(over) else 0)
        plan = PaddedPlan(capacity, tuple(int(e) for e in over), over_cap)
        if plan.rows(len(counts)) <= max_rows and (best is None or total <= best[0]):
            best = (total, plan)
    return None if best is None else best[1]


def test_plan_padded_equals_the_loop_over_capacities():
    rng = np.random.default_rng(3)
    for trial in range(200):
        experts = int(rng.integers(1, 40))
        counts = rng.zipf(1.5, size=experts).clip(0, 900) if trial % 2 else rng.integers(0, 300, size=experts)
        counts[rng.integers(0, experts)] += 1  # at least one pair
        cost = OverflowCost(float(rng.choice([0.0, 50.0, 900.0])), float(rng.choice([1.0, 1.3, 2.0, 14.0])))
        max_rows = float(rng.choice([np.inf, 1.2 * counts.sum(), 2.0 * counts.sum()]))
        assert plan_padded(counts, cost, max_rows) == _plan_by_loop(counts, cost, max_rows), (counts.tolist(), cost, max_rows)


def test_overflow_cost_follows_the_device_and_the_weights(monkeypatch):
    plain, quantized = _weights(), _quantized_weights()
    assert moe_mod.overflow_cost(plain) == moe_mod.OVERFLOW_COST[("cpu", "plain")]
    assert moe_mod.overflow_cost(quantized) == moe_mod.OVERFLOW_COST[("cpu", "quantized")]
    monkeypatch.setattr(moe_mod, "on_cuda", lambda: True)
    assert moe_mod.overflow_cost(plain) == moe_mod.OVERFLOW_COST[("cuda", "plain")]
    assert moe_mod.overflow_cost(quantized) == moe_mod.OVERFLOW_COST[("cuda", "quantized")]
    # the H200's session-5 routings (4,096 rows, 256 experts): bf16 one block for random routing, as measured
    random_counts = np.full(256, 96)
    random_counts[:7] = 119
    assert plan_padded(random_counts, moe_mod.overflow_cost(plain), 2.0 * 24576).overflow == ()


def _quantized_weights() -> MoEWeights:
    base = _weights()
    return dataclasses.replace(base, **{n: quantize(getattr(base, n), "mxfp4", 32) for n in ("w1", "w2", "w3")})


@row_invariant_blas
@pytest.mark.parametrize("overflow", [False, True])
def test_padding_rows_do_not_reach_any_result(overflow, monkeypatch):
    """Padding rows read some token (not zeros); pointing them at another token changes no bit."""
    w = _weights()
    mx.random.seed(11)
    x = mx.random.normal((60, DIM))
    experts = _skewed_experts(60)
    _, weights = route(x, None, w, TOP_K, 1.5)
    if not overflow:
        monkeypatch.setitem(moe_mod.OVERFLOW_COST, ("cpu", "plain"), None)
    base = routed_experts(x, experts, weights, w, LIMIT, layout="padded")
    tables = moe_mod.padded_tables

    def other_padding(counts, plan):
        t = tables(counts, plan)
        assert (len(plan.overflow) > 0) == overflow
        padding = np.ones(len(t.source), dtype=bool)
        padding[t.slot] = False
        assert padding.any()
        return moe_mod.PaddedTables(np.where(padding, len(t.slot) - 1, t.source).astype(np.int32), t.slot)

    monkeypatch.setattr(moe_mod, "padded_tables", other_padding)
    assert np.array_equal(np.array(base), np.array(routed_experts(x, experts, weights, w, LIMIT, layout="padded")))
    assert np.array_equal(np.array(base), np.array(reference_routed_experts(x, experts, weights, w, LIMIT)))


@row_invariant_blas
@pytest.mark.parametrize("overlap", [True, False])
def test_moe_block_is_the_same_with_and_without_host_overlap(overlap, monkeypatch):
    """moe() in a padded step (async_eval around the count's sync) equals moe() in a gathered one."""
    w = _weights()
    mx.random.seed(12)
    x = mx.random.normal((70, DIM))
    monkeypatch.setattr(moe_mod, "OVERLAP_HOST_WORK", overlap)
    monkeypatch.setattr(moe_mod, "PADDED_MIN_PAIRS_PER_EXPERT", 0)
    padded = moe(x, None, w, TOP_K, 1.5, LIMIT)
    monkeypatch.setattr(moe_mod, "PADDED_MIN_PAIRS_PER_EXPERT", 10**9)
    gathered = moe(x, None, w, TOP_K, 1.5, LIMIT)
    assert float(mx.abs(gathered).max()) > 0.1
    assert np.array_equal(np.array(padded), np.array(gathered))


@pytest.mark.parametrize("max_rows_per_pair, falls_back", [(2.0, False), (1.1, True)])
def test_padded_layout_falls_back_when_padding_would_exceed_its_bound(max_rows_per_pair, falls_back, monkeypatch):
    w = _weights()
    mx.random.seed(9)
    x = mx.random.normal((50, DIM))
    experts = _skewed_experts(50)  # plan: 8·16 + 48 = 176 rows for 100 pairs
    _, weights = route(x, None, w, TOP_K, 1.5)
    calls = []
    gathered = moe_mod.gathered_pairs
    monkeypatch.setattr(moe_mod, "gathered_pairs", lambda *a: calls.append(1) or gathered(*a))
    monkeypatch.setattr(moe_mod, "PADDED_MAX_ROWS_PER_PAIR", max_rows_per_pair)
    out = routed_experts(x, experts, weights, w, LIMIT, layout="padded")
    assert bool(calls) == falls_back
    assert np.allclose(np.array(out), np.array(reference_routed_experts(x, experts, weights, w, LIMIT)), atol=1e-5)


def test_layout_follows_pairs_per_expert():
    assert moe_mod.uses_padded_layout(moe_mod.PADDED_MIN_PAIRS_PER_EXPERT * 256, 256)
    assert not moe_mod.uses_padded_layout(6, 256)  # one decode token, top-6


def test_skewed_v4_flash_step_runs_one_block_on_cuda():
    """The H200's measured skew (20 % of 256 experts drawn 4x as often, 4,096 rows x top-6; busiest expert
    276 pairs): one block of 288 rows an expert (10.8 ms there) must fit the row bound and beat the plan with
    an overflow block (20.2 ms): docs/BENCHMARKS.md "Session 6 on the H200 ... the MoE's parts"."""
    counts = np.array([276] + [240] * 50 + [60] * 205, dtype=np.int64)  # 24,576 pairs in all
    assert counts.sum() == 24576 and counts.min() > 0
    bf16_cuda = moe_mod.OVERFLOW_COST[("cuda", "plain")]
    plan = moe_mod.plan_padded(counts, bf16_cuda, moe_mod.PADDED_MAX_ROWS_PER_PAIR * counts.sum())
    assert plan is not None and plan.overflow == () and plan.capacity == 288


def _indices_as_the_kernel_computes_them(order: np.ndarray, flat: np.ndarray, counts: np.ndarray, cap: int, over_cap: int, k: int):
    """kernels/moe_padded.py's _INDEX_SOURCE, thread by thread in numpy: what the CPU can check of the
    kernel's formulation (the kernel itself: tests/test_kernels_cuda.py)."""
    num_experts = len(counts)
    starts = np.cumsum(counts) - counts  # the block's exclusive scans
    is_over = (counts > cap).astype(np.int64)
    over_rank = np.cumsum(is_over) - is_over
    over_experts = np.flatnonzero(is_over)
    num_rows = num_experts * cap + len(over_experts) * over_cap
    tokens = np.empty(num_rows, dtype=np.int64)
    for t in range(num_rows):
        if t < num_experts * cap:
            e, rank = t // cap, t % cap
        else:
            r = t - num_experts * cap
            e, rank = over_experts[r // over_cap], cap + r % over_cap
        tokens[t] = order[starts[e] + rank if rank < counts[e] else 0] // k
    slot = np.empty(len(order), dtype=np.int64)
    for i, pair in enumerate(order):
        e = flat[pair]
        rank = i - starts[e]
        slot[pair] = e * cap + rank if rank < cap else num_experts * cap + over_rank[e] * over_cap + rank - cap
    return tokens, slot


@pytest.mark.parametrize("cost", [OverflowCost(0.0, 1.0), None])
def test_index_kernels_formulation_gives_the_reference_tables(cost):
    """The index kernel's formulation (a row finds its pair; a pair its row; the overflow experts are
    those over the capacity) equals the reference tables (host tables, gather, division, scatter), with
    and without an overflow block."""
    flat = np.array(_skewed_experts(50)).reshape(-1)
    order = np.array(mx.argsort(mx.array(flat)))
    counts = _counts(flat)
    plan = plan_padded(counts, cost)
    assert (plan.overflow == (3,)) == (cost is not None)
    want_tokens, want_slot = moe_mod.padded_indices_reference(mx.array(order), counts, plan, TOP_K)
    tokens, slot = _indices_as_the_kernel_computes_them(order, flat, counts, plan.capacity, plan.overflow_capacity, TOP_K)
    assert len(tokens) == plan.rows(EXPERTS)
    assert np.array_equal(tokens, np.array(want_tokens)) and np.array_equal(slot, np.array(want_slot))


def test_combine_rows_off_cuda_is_the_gather_and_weighted_sum():
    """combine_rows (kernels/moe_padded.py) on the CPU is its reference: rows[slot] weighted and summed per
    token; and that sum adds each token's k float32 products onto 0 in slot order, the order the CUDA
    kernel repeats (MLX CUDA's col_reduce_small)."""
    from tessera.kernels import moe_padded

    rng = np.random.default_rng(4)
    tokens, k, dim = 37, 6, 24
    rows = mx.array(rng.standard_normal((50, dim)).astype(np.float32) * 10.0 ** rng.integers(-3, 4, (50, 1)))
    slot = mx.array(rng.integers(0, 50, tokens * k).astype(np.int32))
    weights = mx.array(rng.uniform(0.01, 2.0, (tokens, k)).astype(np.float32))
    assert not moe_padded.combine_is_supported(rows, slot, weights)  # CPU: the reference runs
    got = np.array(moe_padded.combine_rows(rows, slot, weights))
    by_pair = np.array(rows)[np.array(slot)].reshape(tokens, k, dim)
    want = np.zeros((tokens, dim), dtype=np.float32)
    for j in range(k):
        want = want + by_pair[:, j, :] * np.array(weights)[:, j:j + 1]  # float32 products and sums, in slot order
    assert want.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(got, np.array(moe_padded.combine_rows_reference(rows, slot, weights)))
    bf16 = rows.astype(mx.bfloat16)
    assert np.array_equal(np.array(moe_padded.combine_rows(bf16, slot, weights)),
                          np.array(moe_padded.weighted_sum(bf16[slot].reshape(tokens, k, dim), weights)))


@row_invariant_blas
def test_padded_layout_combines_per_token_as_the_pairs_form(monkeypatch):
    """routed_experts through the padded layout (the blocks combined per token) equals padded_pairs' [P, D]
    rows weighted and summed, and the per-expert loop, bit for bit."""
    w = _weights()
    mx.random.seed(13)
    x = mx.random.normal((90, DIM))
    experts = _skewed_experts(90)
    _, weights = route(x, None, w, TOP_K, 1.5)
    flat = experts.reshape(-1)
    by_pair = moe_mod.padded_pairs(x, flat, mx.argsort(flat), TOP_K, w, LIMIT)
    pairs_form = moe_mod._weighted_sum(by_pair.reshape(90, TOP_K, DIM), weights)
    out = routed_experts(x, experts, weights, w, LIMIT, layout="padded")
    assert np.array_equal(np.array(out), np.array(pairs_form))
    assert np.array_equal(np.array(out), np.array(reference_routed_experts(x, experts, weights, w, LIMIT)))


# ---- the router after its product (kernels/moe_route.py) ----------------------------------------------


def _hash_weights(w: MoEWeights, vocab: int = 40, seed: int = 3) -> MoEWeights:
    """`w` as a hash-routed layer: no bias, a token -> TOP_K distinct experts table held in uint32."""
    rng = np.random.default_rng(seed)
    table = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(vocab)]).astype(np.uint32)
    return dataclasses.replace(w, correction_bias=None, tid2eid=mx.array(table))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "plain"])
@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hash"])
def test_the_route_references_are_the_engines_route_bit_for_bit(dtype, enabled, hashed, monkeypatch):
    """kernels/moe_route.py's `route_reference` and `hash_route_reference` (what its CUDA kernels are held to) are
    `route` where the kernels do not run, on the router's product: the same experts in the same order, the same
    weights' bits, compiled and plain, rows of either dtype (a scaling other than 1, so a dropped one shows)."""
    from tessera.kernels import moe_route, shapeless

    monkeypatch.setattr(shapeless._switch, "_enabled", enabled)
    w = _hash_weights(_weights()) if hashed else _weights()
    for rows in (1, 5, 3):
        x = (mx.random.normal((rows, DIM), key=mx.random.key(40 + rows)) * 2).astype(dtype)
        ids = mx.array(np.arange(rows) * 7 % 40, dtype=mx.int32)
        logits = moe_route.router_logits(x, w.router_t)  # [T, E] float32
        if hashed:
            want = moe_route.hash_route_reference(logits, w.tid2eid, ids, 1.5)
        else:
            want = moe_route.route_reference(logits, w.correction_bias, TOP_K, 1.5)
        got = route(x, ids, w, TOP_K, 1.5)
        for name, a, b in zip(("experts", "weights"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape == (rows, TOP_K), name
            assert mx.array_equal(a, b).item(), f"{name} differ at {rows} rows"
        assert got[0].dtype == mx.uint32 and got[1].dtype == mx.float32


def test_a_model_hands_the_route_kernels_each_layers_operands_where_they_run(tmp_path, monkeypatch):
    """Where the route kernels are supported (a CUDA decode batch), each learned layer hands `route_kernel` the
    router's product, its correction bias and the config's k and scaling, and each hash layer hands
    `hash_route_kernel` the product, its table and the step's token ids. Stand-ins with the references' contracts
    take their place here: the decode step's logits must be the bits of the path without them (a bias left out, a
    wrong scaling or another token's row would move them), each stand-in called once a layer of its kind."""
    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.model.loader import load_model
    from tessera.engine.tools.make_model import make_model
    from tessera.kernels import moe_route

    model = load_model(make_model(tmp_path / "m", "tiny", seed=5, with_tokenizer=False), dtype="float32")
    cfg = model.cfg
    calls = []

    def stand_in(logits, bias, top_k, scaling):
        assert logits.shape == (1, cfg.n_routed_experts) and logits.dtype == mx.float32 and bias.shape == (cfg.n_routed_experts,)
        assert (top_k, scaling) == (cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        calls.append("learned")
        return moe_route.route_reference(logits, bias, top_k, scaling)

    def hash_stand_in(logits, tid2eid, token_ids, scaling):
        assert logits.shape == (1, cfg.n_routed_experts) and tid2eid.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
        assert token_ids.shape == (1,) and scaling == cfg.routed_scaling_factor
        calls.append("hash")
        return moe_route.hash_route_reference(logits, tid2eid, token_ids, scaling)

    caches = [model.new_cache(), model.new_cache()]
    for cache in caches:
        model.forward([Segment(cache, list(range(3, 20)))])
    want = model.forward([Segment(caches[0], [5])])
    monkeypatch.setattr(moe_route, "is_supported", lambda logits, top_k: logits.shape[0] == 1)
    monkeypatch.setattr(moe_route, "route_kernel", stand_in)
    monkeypatch.setattr(moe_route, "hash_route_kernel", hash_stand_in)
    got = model.forward([Segment(caches[1], [5])])
    num_hash = cfg.mlp_layer_types.count("hash_moe")
    assert 0 < num_hash < cfg.num_hidden_layers  # both kinds of layer are seen
    assert calls == ["hash"] * num_hash + ["learned"] * (cfg.num_hidden_layers - num_hash)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
