"""docs/bench/issue14_decode_host.py (the H200 script for a decode step's host cost) runs by path on the CPU
at tiny sizes — the code path the GPU runs — and reports what its docstring promises."""

from __future__ import annotations

import pytest

from tests.support.bench_script import run_bench_script, tiny_model


def test_decode_host_script_measures_both_paths_with_the_switch_on_and_off(tmp_path):
    rows = run_bench_script("issue14_decode_host.py", tiny_model(tmp_path / "model"), tmp_path / "host.jsonl",
                            "--ctx", "100", "--chunk", "32", "--tile", "8", "--steps", "3", "--cache-fill", "random")
    assert [r["what"] for r in rows][:4] == ["start", "loaded", "cache_filled", "graph_nodes"]
    assert rows[2]["num_tokens"] == 100 and rows[3]["nodes"] > 100
    rounds = [r for r in rows if r["what"] == "round"]
    assert [(r["path"], r["decode_async"]) for r in rounds] == [
        (path, on) for path in ("forward", "runner") for on in (True, False, False, True)]
    for r in rounds:
        assert len(r["steps"]) == 3
        for step in r["steps"]:
            if r["path"] == "forward":
                assert step["total_ms"] == pytest.approx(step["build_ms"] + step["eval_ms"], abs=1e-6)
            else:
                assert step["total_ms"] == pytest.approx(step["forward_ms"] + step["eval_ms"] + step["serving_ms"], abs=1e-6)
                assert min(step["forward_ms"], step["eval_ms"], step["serving_ms"]) > 0
    summaries = {r["path"]: r for r in rows if r["what"] == "summary"}
    assert set(summaries) == {"forward", "runner"}
    assert summaries["runner"]["steps_on"] == summaries["runner"]["steps_off"] == 6
    assert summaries["forward"]["total_ms_on_over_off"] > 0
    assert rows[-1]["what"] == "done"
