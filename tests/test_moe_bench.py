"""docs/bench/issue14_moe_parts.py (the MoE's pieces on the GPU) runs end to end on the CPU at tiny shapes — the
same code path as on the H200 — computes what the engine computes, and times what it promises, in A B … B A order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ["session5", "session5_one_block", "new", "new_mlx_gather", "new_one_block", "new_overflow",
           "next", "next_no_combine_kernel", "next_no_index_kernel", "next_scheduled_as_moe"]
WHOLE_ONLY = {"next_scheduled_as_moe"}  # timed as whole calls only (no parts)
REFERENCES = ["matmul_moe_shapes", "weights_read", "batched_gemm_only", "batched_gemm_fused_gate_up"]
PIECES = {"sort_counts", "sync_plan", "indices", "gather_in", "gemm_gate_up", "swiglu", "gemm_down", "gather_out",
          "weighted_sum", "shared_expert", "sum"}
NEXT_PIECES = PIECES - {"gather_out", "weighted_sum"} | {"combine"}  # one kernel combines the rows per token


def test_parts_script_runs_small_on_the_cpu_and_reports_every_piece(tmp_path):
    out = tmp_path / "parts.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # its checks expect exact equality
    done = subprocess.run([sys.executable, "docs/bench/issue14_moe_parts.py", str(out), "--small", "--iters", "1",
                           "--warmup", "0", "--chain", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    checks = [r for r in rows if r["what"] == "check"]
    assert len(checks) == 2 * len(LAYOUTS) + 2 and all(r["max_abs_diff"] == 0.0 for r in checks)  # same bits as the engine
    for routing in ("random", "skewed"):
        order = [r["setting"] for r in rows if r["what"] == "round" and r["routing"] == routing and "experts" not in r]
        assert order == REFERENCES + LAYOUTS + (REFERENCES + LAYOUTS)[::-1]  # A B … B A
        summary = {r["setting"]: r for r in rows if r["what"] == "summary" and r["routing"] == routing}
        assert list(summary) == REFERENCES + LAYOUTS
        assert summary["matmul_moe_shapes"]["fraction_of_matmul"] == 1.0
        for name in LAYOUTS:
            s = summary[name]
            assert s["ms_median"] > 0 and s["fraction_of_matmul"] > 0 and len(s["ms_round_medians"]) == 2
            if name in WHOLE_ONLY:
                assert s["parts_ms"] is None
                continue
            pieces = NEXT_PIECES if name.startswith("next") else PIECES
            assert pieces <= set(s["parts_ms"]) and s["parts_sum_ms"] == sum(s["parts_ms"].values())
            assert not name.startswith("next") or not {"gather_out", "weighted_sum"} & set(s["parts_ms"])
        plan = next(r for r in rows if r["what"] == "plan" and r["routing"] == routing and "experts" not in r)
        # the skewed routing makes the CPU's costs take an overflow block; one block never has one
        assert ("overflow_block" in summary["new_overflow"]["parts_ms"]) == (plan["overflow_experts"] > 0) == (routing == "skewed")
        assert "overflow_block" not in summary["new_one_block"]["parts_ms"]
    served = {r["setting"]: r for r in rows if r["what"] == "summary_served"}
    assert set(served) == {"served_overlap", "served_no_overlap", "served_overlap_no_padded_kernels"}
    assert all(r["ms_per_layer"] > 0 for r in served.values())
    assert {(r["routing"], r["setting"]) for r in rows if r["what"] == "summary_mxfp4"} == {
        (k, s) for k in ("random", "skewed") for s in ("new", "new_one_block", "new_overflow", "next")}
    fits = {r["experts"]: r for r in rows if r["what"] == "overflow_cost_fit"}
    assert set(fits) == {"plain", "mxfp4"}
    for fit in fits.values():  # the inputs of the fit are the plans the layouts ran
        assert fit["skewed"]["over_rows"] > 0 and fit["skewed"]["one_rows"] > fit["random"]["one_rows"]
        assert fit["fit"] is None or set(fit["fit"]) == {"fixed_rows", "per_row"}
    assert rows[-1]["what"] == "done"


def _parts_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("issue14_moe_parts", ROOT / "docs/bench/issue14_moe_parts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_overflow_cost_fit_recovers_the_cost_that_made_the_timings():
    fit_overflow_cost = _parts_module().fit_overflow_cost
    base, row_ms, fixed_ms, over_row_ms = 3.0, 0.001, 2.0, 0.01  # a main row 1 µs; overflow 2 ms + 10 µs a row

    def point(one_rows, main_rows, over_rows):
        return {"one_ms": base + one_rows * row_ms, "one_rows": one_rows, "over_main_rows": main_rows, "over_rows": over_rows,
                "over_ms": base + main_rows * row_ms + (fixed_ms + over_rows * over_row_ms if over_rows else 0.0)}

    # session 5's H200 plans: one block 32,768 / 73,728 rows; overflow plans 28,672 + 112 and 20,480 + 10,608
    fit = fit_overflow_cost({"random": point(32768, 28672, 112), "skewed": point(73728, 20480, 10608)})
    assert fit["fit"]["fixed_rows"] == pytest.approx(2000.0) and fit["fit"]["per_row"] == pytest.approx(10.0)
    assert fit["main_row_ms"] == pytest.approx(row_ms)
    same = fit_overflow_cost({"random": point(32768, 28672, 112), "skewed": point(32768, 20480, 10608)})
    assert same["fit"] is None  # the one-block points cannot give a row's time
    none = fit_overflow_cost({"random": point(32768, 32768, 0), "skewed": point(73728, 20480, 10608)})
    assert none["fit"] is None and none["overflow_block_ms"]["random"] == pytest.approx(0.0)
