"""docs/bench's decode probes of sessions 12 and 13 (docs/BENCHMARKS.md "Session 12 on the H200", "Session 13 …")
run by path on the CPU at tiny sizes, as the H200 runs them, and report what their docstrings promise:
issue14_step_timeline.py every arm and batch size in alternating rounds with the host's split (the device's own
time needs a GPU: None here); compiled_step_bits.py the compiled and plain steps' difference (0.0 on the CPU) and
the warm-up per batch size; decode_encode_split.py each stage's encoding per batch size in A B B A rounds;
overlap_append_memory.py (session 17) the peak memory of serial and overlapped steps in alternating rounds;
mlx_thread_overlap.py (session 27) each graph builder timed alone and while a second thread encodes;
issue14_primitive_count.py (session 28) what a step that closes CSA windows adds to the graph, and (session 34) the
CUDA path's graph counted on the CPU with the kernels stood in (docs/bench/cuda_standin.py)."""

from __future__ import annotations

from tests.equivalence.row_invariant_blas import row_invariant_blas
from tessera.engine.model.config import CSA
from tests.support.bench_script import TINY_OVERRIDES, run_bench_script, run_printing_script, run_probe_script, tiny_model


def test_step_timeline_reports_the_host_split_of_every_arm_in_alternating_rounds(tmp_path):
    rows = run_bench_script("issue14_step_timeline.py", tiny_model(tmp_path / "model"), tmp_path / "timeline.jsonl",
                            "--ctx", "100", "--steps", "3", "--rounds", "1", "--arms", "off", "compiled_thread", "compiled_unstacked",
                            "compiled_no_mxfp8_qmv", "compiled_sinkhorn_thread", "compiled_no_hc_mix",
                            "compiled_no_hc_collapse", "compiled_no_hc_expand", "compiled_no_moe_route",
                            "compiled_no_decode_attention", "compiled_no_rms_norm")
    rounds = [r for r in rows if r["what"] == "round"]
    order = ["off", "compiled_thread", "compiled_unstacked", "compiled_no_mxfp8_qmv", "compiled_sinkhorn_thread",
             "compiled_no_hc_mix", "compiled_no_hc_collapse", "compiled_no_hc_expand", "compiled_no_moe_route",
             "compiled_no_decode_attention", "compiled_no_rms_norm"]
    assert [r["arm"] for r in rounds] == order + order[::-1]
    # each arm changes its one switch from the defaults (the compiled step, every kernel on), read back in the round
    defaults = {"step_compile": True, "stacked_inputs": True, "mxfp8_qmv": True, "sinkhorn_warp": True, "hc_mix": True,
                "hc_collapse": True, "hc_expand": True, "moe_route": True, "decode_attention": True,
                "rms_norm": True}
    changed = {"off": {"step_compile": False}, "compiled_thread": {}, "compiled_unstacked": {"stacked_inputs": False},
               "compiled_no_mxfp8_qmv": {"mxfp8_qmv": False}, "compiled_sinkhorn_thread": {"sinkhorn_warp": False},
               "compiled_no_hc_mix": {"hc_mix": False}, "compiled_no_hc_collapse": {"hc_collapse": False},
               "compiled_no_decode_attention": {"decode_attention": False},
               "compiled_no_hc_expand": {"hc_expand": False}, "compiled_no_moe_route": {"moe_route": False}, "compiled_no_rms_norm": {"rms_norm": False}}
    for r in rounds:
        switches = {k: v for k, v in r["switches"].items() if k != "decode_async"}
        assert switches == {**defaults, **changed[r["arm"]]}, r["arm"]
    for r in rounds:
        assert len(r["steps"]) == 3 and r["build_ms"] > 0 and r["encode_ms"] >= 0 and r["wait_ms"] >= 0
        assert r["host_step_ms"] >= r["build_ms"] and r["device_ms"] is None


def test_step_timeline_runs_every_batch_size_in_each_arm_of_a_round(tmp_path):
    rows = run_bench_script("issue14_step_timeline.py", tiny_model(tmp_path / "model"), tmp_path / "timeline.jsonl",
                            "--ctx", "100", "--steps", "2", "--rounds", "1", "--arms", "off", "--batch", "3", "1")
    assert [(r["arm"], r["batch"]) for r in rows if r["what"] == "warm"] == [("off", 3), ("off", 1)]
    assert [(r["arm"], r["batch"]) for r in rows if r["what"] == "round"] == [("off", 3), ("off", 1)] * 2


def test_encode_split_times_every_stage_of_each_batch_size_in_alternating_rounds(tmp_path):
    rows = run_bench_script("decode_encode_split.py", tiny_model(tmp_path / "model"), tmp_path / "split.jsonl",
                            "--ctx", "100", "--steps", "2", "--rounds", "1", "--batch", "3", "1", "--compile-step", "off")
    rounds = [r for r in rows if r["what"] == "round"]
    assert [r["batch"] for r in rounds] == [3, 1, 1, 3]
    for r in rounds:
        assert len(r["steps"]) == 2
        median = r["median_ms"]
        # every stage mark of a decode layer was reached (a stage nobody marks would read 0 here)
        for stage in ("other", "indexer_score", "topk", "attention", "moe", "head"):
            assert median[stage] > 0, stage
        assert median["build_ms"] > 0 and median["step_ms"] >= median["build_ms"] + median["moe"]


def test_compiled_step_bits_compares_both_batch_sizes_and_times_the_warm_up(tmp_path):
    rows = run_bench_script("compiled_step_bits.py", tiny_model(tmp_path / "model"), tmp_path / "bits.jsonl",
                            "--ctx", "100", "--batches", "1", "3", "--steps", "3", "--warm-up", "4")
    bits = [r for r in rows if r["what"] == "bits"]
    assert [r["batch"] for r in bits] == [1, 3]
    assert all(r["tokens_equal"] and r["logits_max_abs_diff"] == 0.0 and r["caches_max_abs_diff"] == 0.0 for r in bits)
    (warm,) = [r for r in rows if r["what"] == "warm_up"]
    assert sorted(int(b) for b in warm["seconds"]) == [1, 2, 3, 4] and warm["total_seconds"] > 0


@row_invariant_blas  # stacked and separate projections are matmuls of other widths
def test_compiled_step_bits_compares_the_stacked_input_projections_when_asked(tmp_path):
    rows = run_bench_script("compiled_step_bits.py", tiny_model(tmp_path / "model"), tmp_path / "bits.jsonl",
                            "--switch", "stacked_inputs", "--ctx", "100", "--batches", "2", "--steps", "2")
    (bits,) = [r for r in rows if r["what"] == "bits"]
    assert bits["switch"] == "stacked_inputs" and bits["batch"] == 2
    assert bits["tokens_equal"] and bits["logits_max_abs_diff"] == 0.0 and bits["caches_max_abs_diff"] == 0.0


def test_overlap_append_memory_reports_both_arms_peaks_in_alternating_rounds(tmp_path):
    rows = run_bench_script("overlap_append_memory.py", tiny_model(tmp_path / "model"), tmp_path / "append.jsonl",
                            "--ctx", "100", "--steps", "4", "--rounds", "1", "--chunk", "32")
    (filled,) = [r for r in rows if r["what"] == "filled"]
    assert len(filled["buffer_mib"]) == 2  # the tiny model's two CSA layers
    rounds = [r for r in rows if r["what"] == "round"]
    assert [r["arm"] for r in rounds] == ["serial", "overlapped", "overlapped", "serial"]
    assert all(len(r["step_ms"]) == 4 and isinstance(r["peak_mib"], float) for r in rounds)
    summary = rows[-1]
    assert summary["what"] == "summary" and {"serial_peak_mib", "overlapped_peak_mib"} <= set(summary)


def test_append_donation_probe_times_the_append_with_and_without_a_reader_in_flight(tmp_path):
    rows = run_probe_script("append_donation_probe.py", tmp_path / "append.jsonl", "--mib", "8", "--rounds", "2")
    assert len(rows) == 2 and all(r["mib"] == 8 for r in rows)
    assert all(r["reader_and_append_ms"] > 0 and r["append_alone_ms"] > 0 and r["reader_ms"] > 0 for r in rows)


def test_thread_overlap_probe_times_every_builder_alone_and_during_an_encode(tmp_path):
    """docs/bench/mlx_thread_overlap.py (no model): a line per builder, in its order, with the build and the
    encode timed alone and together, and their overlap computed from those times."""
    rows = run_probe_script("mlx_thread_overlap.py", tmp_path / "overlap.jsonl", "--nodes", "32", "--reps", "2")
    assert [r["builder"] for r in rows] == ["python", "views", "ops", "scalars", "compiled", "ops_other_stream"]
    for r in rows:
        times = [r[k] for k in ("build_alone_ms", "encode_alone_ms", "build_during_ms", "encode_during_ms", "both_ms")]
        assert all(t > 0 for t in times), r
        # the line's times are rounded medians; the overlap is of the unrounded ones
        assert abs(r["overlap"] - (r["build_alone_ms"] + r["encode_alone_ms"]) / r["both_ms"]) < 0.01, r


def test_primitive_count_shows_what_a_window_closing_step_adds(tmp_path):
    """Four consecutive steps at CSA ratio 4: one closes each CSA layer's two compressors' windows, and its
    extra nodes include one slice update a closing compressor a sequence (the appends that grow with B)."""
    model = tiny_model(tmp_path / "model")
    rows = run_printing_script("issue14_primitive_count.py", model, "--batch", "1", "3", "--ctx", "100", "--steps", "2",
                               "--count-steps", "4")
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        totals = r["step_totals"]
        assert len(totals) == 4 and totals[0] == r["total"]
        assert sorted(totals)[:3] == [min(totals)] * 3 and max(totals) > min(totals)  # one step of four closes
        closing_compressors = 2 * TINY_OVERRIDES["layer_types"].count(CSA)
        assert r["closing_extra"]["SliceUpdate"] == closing_compressors * r["batch"]


def test_primitive_count_as_cuda_counts_the_cuda_paths_graph_on_the_cpu(tmp_path):
    """--as-cuda builds the step the CUDA path builds: kernels where a GPU runs them (one CustomKernel node each:
    no Sinkhorn iterations left, kernels/sinkhorn.py), MLX's one-node RMSNorm, the step compiled; fewer nodes
    than the CPU's own path, and only the build timed."""
    model = tiny_model(tmp_path / "model")
    cpu, = run_printing_script("issue14_primitive_count.py", model, "--batch", "2", "--ctx", "100", "--steps", "2",
                               "--step-compile", "1")
    cuda, = run_printing_script("issue14_primitive_count.py", model, "--batch", "2", "--ctx", "100", "--steps", "2",
                                "--as-cuda")
    sinkhorn_iteration = "CompiledBroadcastAddBroadcastDivide"  # the float32 reference's fused divide, 20 a Sinkhorn
    assert cpu["by_kind"].get("CustomKernel", 0) == 0 and cpu["by_kind"][sinkhorn_iteration] > 0
    assert cuda["device"].startswith("cuda path") and cuda["step_compile"]
    assert cuda["by_kind"]["CustomKernel"] >= 2 * len(TINY_OVERRIDES["layer_types"])  # a Sinkhorn per collapse at least
    assert cuda["by_kind"]["RMSNorm"] > 0 and sinkhorn_iteration not in cuda["by_kind"]
    assert cuda["total"] < cpu["total"]
    assert "eval_ms_median" not in cuda and cuda["build_ms_median"] > 0


def test_the_cuda_stand_in_is_undone_after_it():
    """Inside `cuda_graph_on_cpu` the engine sees CUDA and its kernels; after it, the CPU again (the process goes on
    counting or running the CPU's own path)."""
    import mlx.core as mx

    from docs.bench.cuda_standin import cuda_graph_on_cpu
    from tessera.engine.model import compiled, moe
    from tessera.kernels import cuda, sinkhorn

    comb = mx.ones((1, 4, 4))
    before = (compiled.step_compile_enabled(), moe.OVERLAP_HOST_WORK, mx.fast.rms_norm, sinkhorn.is_supported(comb))
    with cuda_graph_on_cpu():
        assert cuda.on_cuda() and sinkhorn.is_supported(comb) and compiled.step_compile_enabled()
        out = sinkhorn.mixing_kernel(comb, 20, 1e-6, mx.bfloat16)
        assert out.shape == comb.shape and out.dtype == mx.bfloat16
    assert not cuda.on_cuda() and before == (compiled.step_compile_enabled(), moe.OVERLAP_HOST_WORK, mx.fast.rms_norm,
                                               sinkhorn.is_supported(comb))
