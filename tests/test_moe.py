"""The routed experts' two layouts (engine/model/moe.py) against the plain per-expert loop.

Gathered (one row per pair, decode) and padded ([E, capacity, D] batched matmuls, prefill) must both
equal `reference_routed_experts`; in float32 with MLX's bundled BLAS bit for bit (a row's product does
not depend on the other rows of its matmul there), so a prefill chunk that runs padded and a decode step
that runs gathered give a token the same result."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import moe as moe_mod
from tessera.engine.model.moe import MoEWeights, PaddedPlan, padded_slots, plan_padded, reference_routed_experts, route, routed_experts
from tessera.engine.model.quantized import quantize
from tests.equivalence.row_invariant_blas import row_invariant_blas

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
    w = MoEWeights(**{**base.__dict__, **q})
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
    w = MoEWeights(**{**base.__dict__, **{n: quantize(getattr(base, n), "mxfp4", 32) for n in ("w1", "w2", "w3")}})
    mx.random.seed(10)
    x = mx.random.normal((40, DIM))
    experts, weights = route(x, None, w, TOP_K, 1.5)
    whole = routed_experts(x, experts, weights, w, LIMIT, layout="gathered")
    monkeypatch.setattr(moe_mod, "GATHER_QMM_MAX_BATCH", 7)  # 80 pairs -> 12 pieces
    pieces = routed_experts(x, experts, weights, w, LIMIT, layout="gathered")
    assert np.array_equal(np.array(whole), np.array(pieces))


def test_dequantized_expert_groups_match_the_loop(monkeypatch):
    base = _weights()
    w = MoEWeights(**{**base.__dict__, **{n: quantize(getattr(base, n), "mxfp4", 32) for n in ("w1", "w2", "w3")}})
    mx.random.seed(8)
    x = mx.random.normal((80, DIM))
    experts = _skewed_experts(80)
    _, weights = route(x, None, w, TOP_K, 1.5)
    ref = reference_routed_experts(x, experts, weights, w, LIMIT)  # the loop runs on dequantized weights too
    monkeypatch.setattr(moe_mod, "DEQUANTIZE_EXPERT_GROUP", 3)  # groups 0-2, 3-5, 6-7
    out = routed_experts(x, experts, weights, w, LIMIT, layout="padded")
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=0, atol=1e-6 * float(mx.abs(ref).max()))


def test_padded_slots_are_a_packing_of_each_experts_pairs():
    experts = _skewed_experts(50).reshape(-1)  # expert 3: 50 pairs, the others ~8, expert 6 none
    order = mx.argsort(experts)
    slot, plan = padded_slots(experts, order, EXPERTS, overflow_row_cost=1.0)
    slot_np, experts_np = np.array(slot), np.array(experts)
    assert plan.capacity == 16 and plan.overflow == (3,) and plan.overflow_capacity == 48  # 34 more, rounded up
    assert len(set(slot_np.tolist())) == len(slot_np) and slot_np.max() < plan.rows(EXPERTS)  # one row per pair
    main = slot_np < EXPERTS * plan.capacity
    assert np.array_equal(slot_np[main] // plan.capacity, experts_np[main])  # each pair in its expert's block
    for e in range(EXPERTS):  # each expert's pairs fill its first rows, then its overflow rows
        rows = np.sort(slot_np[experts_np == e])
        n = len(rows)
        first = list(range(e * plan.capacity, e * plan.capacity + min(n, plan.capacity)))
        rest = list(range(EXPERTS * plan.capacity, EXPERTS * plan.capacity + n - len(first)))
        assert rows.tolist() == first + rest


def test_plan_padded_takes_the_fewest_rows():
    uniform = np.array([90, 96, 100, 101])
    assert plan_padded(uniform, 2.0) == PaddedPlan(112, (), 0)  # one block, the busiest expert rounded up
    skewed = np.array([240, 60, 60, 60, 60, 60, 60, 60])
    plan = plan_padded(skewed, 2.0)
    assert plan == PaddedPlan(64, (0,), 176)  # 8·64 + 2·176 = 864 row-costs < 8·240 = 1920
    assert plan.rows(8) == 8 * 64 + 176
    assert plan_padded(skewed, 100.0) == PaddedPlan(240, (), 0)  # a costly overflow block is avoided


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
