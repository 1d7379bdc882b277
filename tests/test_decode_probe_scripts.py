"""docs/bench's session-12 decode probes (docs/BENCHMARKS.md "Session 12 on the H200") run by path on the CPU at
tiny sizes, as the H200 runs them, and report what their docstrings promise: issue14_step_timeline.py every arm
in alternating rounds with the host's split (the device's own time needs a GPU: None here);
compiled_step_bits.py the compiled and plain steps' difference (0.0 on the CPU) and the warm-up per batch size."""

from __future__ import annotations

from tests.support.bench_script import run_bench_script, tiny_model


def test_step_timeline_reports_the_host_split_of_every_arm_in_alternating_rounds(tmp_path):
    rows = run_bench_script("issue14_step_timeline.py", tiny_model(tmp_path / "model"), tmp_path / "timeline.jsonl",
                            "--ctx", "100", "--steps", "3", "--rounds", "1", "--arms", "off", "compiled_thread")
    rounds = [r for r in rows if r["what"] == "round"]
    assert [r["arm"] for r in rounds] == ["off", "compiled_thread", "compiled_thread", "off"]
    for r in rounds:
        assert len(r["steps"]) == 3 and r["build_ms"] > 0 and r["encode_ms"] >= 0 and r["wait_ms"] >= 0
        assert r["host_step_ms"] >= r["build_ms"] and r["device_ms"] is None


def test_compiled_step_bits_compares_both_batch_sizes_and_times_the_warm_up(tmp_path):
    rows = run_bench_script("compiled_step_bits.py", tiny_model(tmp_path / "model"), tmp_path / "bits.jsonl",
                            "--ctx", "100", "--batches", "1", "3", "--steps", "3", "--warm-up", "4")
    bits = [r for r in rows if r["what"] == "bits"]
    assert [r["batch"] for r in bits] == [1, 3]
    assert all(r["tokens_equal"] and r["logits_max_abs_diff"] == 0.0 and r["caches_max_abs_diff"] == 0.0 for r in bits)
    (warm,) = [r for r in rows if r["what"] == "warm_up"]
    assert sorted(int(b) for b in warm["seconds"]) == [1, 2, 3, 4] and warm["total_seconds"] > 0
