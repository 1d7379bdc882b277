"""docs/bench/issue14_step_compile.py (the H200 script for the fixed-shape compiled decode step) runs by
path on the CPU at tiny sizes — the code path the GPU runs — and reports what its docstring promises."""

from __future__ import annotations

import pytest

from tests.support.bench_script import run_bench_script, tiny_model


def test_step_compile_script_measures_both_arms_in_alternating_rounds(tmp_path):
    rows = run_bench_script("issue14_step_compile.py", tiny_model(tmp_path / "model"), tmp_path / "step.jsonl",
                            "--ctx", "100", "--chunk", "32", "--tile", "8", "--steps", "2", "--batch", "1", "3")
    for batch in (1, 3):
        mine = [r for r in rows if r.get("batch") == batch]
        assert [r["what"] for r in mine][:3] == ["first_step", "primitives", "primitives"]
        off, on = mine[1], mine[2]
        assert (off["step_compile"], on["step_compile"]) == (False, True) and on["total"] > 0 and off["total"] > 0
        rounds = [r for r in mine if r["what"] == "round"]
        assert [r["step_compile"] for r in rounds] == [False, True, True, False, True, False, False, True]
        for r in rounds:
            assert len(r["steps"]) == 2
            for step in r["steps"]:
                assert step["total_ms"] == pytest.approx(step["build_ms"] + step["eval_ms"], abs=1e-6)
        summary = mine[-1]
        assert summary["what"] == "summary" and summary["steps_on"] == summary["steps_off"] == 8
        assert summary["total_ms_on_over_off"] > 0
    assert rows[-1]["what"] == "done"
