"""engine/model/expert_slices.py: MLX CUDA's grouped GEMM offsets expert weights with a 32-bit int
product; the sliced gather must give exactly what one gather_mm gives (checked here on the CPU with
a lowered limit, so the slicing runs on small shapes)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import expert_slices
from tessera.engine.model.expert_slices import overflowing_expert, sorted_gather_mm
from tessera.engine.tools.make_model import preset_config
from tests.equivalence.row_invariant_blas import row_invariant_blas


def _mlx_cuda_offset(group: int, itemsize: int, expert_elements: int) -> int:
    """`group * item_size * b_batch_stride` as prepare_grouped_mm_data computes it: 32-bit int."""
    with np.errstate(over="ignore"):
        return int(np.int32(group) * np.int32(itemsize) * np.int32(expert_elements))


@pytest.mark.parametrize("preset", ["flash-width", "flash-attn", "small"])
def test_the_first_overflowing_expert_is_where_the_32_bit_offset_goes_wrong(preset):
    cfg = preset_config(preset)
    elements = cfg.hidden_size * cfg.moe_intermediate_size  # w1 / w3 / w2 per expert
    wrong = [g for g in range(cfg.n_routed_experts) if _mlx_cuda_offset(g, 2, elements) != g * 2 * elements]
    assert overflowing_expert(cfg.n_routed_experts, elements, 2) == (wrong[0] if wrong else None)
    if preset == "flash-width":  # V4 Flash's MoE width in bf16: experts 128-255 are affected
        assert wrong[0] == 128 and len(wrong) == 128


def _case(num_rows: int, num_experts: int, seed: int):
    rng = np.random.default_rng(seed)
    experts = np.sort(rng.integers(0, num_experts, num_rows)).astype(np.uint32)
    experts[experts == 5] = 6  # an expert with no rows, inside a slice
    x = mx.array(rng.standard_normal((num_rows, 1, 24)).astype(np.float32))
    w_t = mx.array(rng.standard_normal((num_experts, 40, 24)).astype(np.float32)).swapaxes(-1, -2)  # [E, in, out] view
    return x, w_t, mx.array(experts)


@pytest.mark.parametrize("num_rows", [7, expert_slices.CLAMPED_MAX_ROWS, expert_slices.CLAMPED_MAX_ROWS + 61])
def test_sliced_gather_equals_one_gather(num_rows):
    x, w_t, experts = _case(num_rows, 11, seed=num_rows)
    limit = 3 * 24 * 40 * 4  # slices of 3 experts: [0,3) [3,6) [6,9) [9,11)
    assert overflowing_expert(11, 24 * 40, 4, limit) == 3
    expected = mx.gather_mm(x, w_t, rhs_indices=experts, sorted_indices=True)
    got = sorted_gather_mm(x, w_t, experts, limit)
    assert got.shape == expected.shape and np.array_equal(np.array(got), np.array(expected))


def test_rows_of_one_slice_only():
    x, w_t, _ = _case(300, 11, seed=1)
    experts = mx.full((300,), 10, dtype=mx.uint32)  # every row in the last slice
    expected = mx.gather_mm(x, w_t, rhs_indices=experts, sorted_indices=True)
    assert np.array_equal(np.array(sorted_gather_mm(x, w_t, experts, 3 * 24 * 40 * 4)), np.array(expected))


@row_invariant_blas  # the expected output runs the padded layout: equal bits for the row-invariant BLAS only
@pytest.mark.parametrize("tokens", [5, 200])  # 10 pairs: clamped slices; 400 pairs: cut slices
def test_the_moe_on_cuda_runs_sliced_experts_and_gets_the_same_output(monkeypatch, tokens):
    from tessera.engine.model import moe as moe_module
    from tessera.engine.model.moe import MoEWeights, moe

    rng = np.random.default_rng(0)
    experts, dim, inter = 9, 16, 24
    r = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32) * 0.3)  # noqa: E731
    w = MoEWeights(router=r(experts, dim), correction_bias=r(experts), tid2eid=None, w1=r(experts, inter, dim),
                   w2=r(experts, dim, inter), w3=r(experts, inter, dim), shared_w1=r(inter, dim), shared_w2=r(dim, inter),
                   shared_w3=r(inter, dim))
    x, ids = r(tokens, dim), mx.arange(tokens)
    expected = moe(x, ids, w, 2, 1.5, 7.0)
    calls = []
    real = expert_slices.sorted_gather_mm
    monkeypatch.setattr(moe_module, "on_cuda", lambda: True)
    monkeypatch.setattr(moe_module, "PADDED_MIN_PAIRS_PER_EXPERT", 10**9)  # the gathered layout: one row per pair
    monkeypatch.setattr(moe_module, "sorted_gather_mm", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setattr(expert_slices, "GROUPED_OFFSET_LIMIT", 4 * inter * dim * 4)  # slices of 4 experts
    reads = []
    real_read = expert_slices._read_cuts
    monkeypatch.setattr(expert_slices, "_read_cuts", lambda *a: (reads.append(1), real_read(*a))[1])
    got = moe(x, ids, w, 2, 1.5, 7.0)
    assert len(calls) == 3 and np.array_equal(np.array(got), np.array(expected))
    # 400 pairs: the gate, up and down products share one read-back of the row cuts; 10 pairs: none
    assert len(reads) == (1 if tokens == 200 else 0)
