"""The issue 17 GPU scripts (docs/bench/issue17_*.py) run end to end on the CPU at tiny sizes — the same
code path as on the GPUs, only the sizes differ — and report what they promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env)  # its PYTHONPATH says how this process imports tessera
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-u", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _records(path: Path) -> dict[str, dict]:
    return {r["event"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("world, rank, layers, counts", [
    (2, 0, [0, 2], {"window": 1, "csa": 1}), (2, 1, [2, 4], {"hca": 1, "csa": 1}), (1, 0, [0, 4], {"window": 1, "csa": 2, "hca": 1}),
])
def test_stage_script_measures_one_rank_and_extrapolates_by_layer_kind(tmp_path, world, rank, layers, counts):
    out = tmp_path / "stage.jsonl"
    done = _run(["docs/bench/issue17_stage.py", str(out), "--preset", "tiny", "--world", str(world), "--rank", str(rank),
                 "--ctx", "300", "--chunk", "64", "--tile", "16", "--decode-steps", "3"])
    assert done.returncode == 0, done.stderr
    r = _records(out)
    assert r["start"]["layers"] == layers
    assert (r["weights"]["vocab_bytes"] > 0) == (rank == 0)
    assert {"mxfp8", "mxfp4"} <= set(r["weights"]["bytes_by_format"])  # official format, made in memory
    assert r["prefill"]["complete"] and r["prefill"]["tokens"] == 300
    assert set(r["prefill"]["kind_seconds"]) == set(counts)  # one layer of each kind ran
    assert len(r["prefill"]["layer_seconds"]) == len(counts)
    assert r["decode"]["ctx"] == 300 and len(r["decode"]["step_ms"]) == 3
    assert set(r["decode"]["kind_ms_synced"]) == set(counts)
    s = r["summary"]
    assert s["kinds_not_measured"] == [] and s["layer_kinds"] == counts
    assert s["rank_prefill_seconds_estimate"] == pytest.approx(sum(
        r["prefill"]["kind_seconds"][k] * n for k, n in s["layer_kinds"].items()))
    assert s["prefill_seconds_estimate_per_rank"][rank] == pytest.approx(s["rank_prefill_seconds_estimate"])
    # each rank of a 2-way tiny split lacks a kind the other holds: no whole-pipeline estimate from one rank
    assert (s["pipeline_prefill_seconds_estimate"] is None) == (world == 2)
    if world == 1:
        assert s["pipeline_prefill_seconds_overlapped_estimate"] == pytest.approx(s["pipeline_prefill_seconds_estimate"])
    assert s["decode_ms_synced_estimate_per_rank"][rank] == pytest.approx(sum(
        r["decode"]["kind_ms_synced"][k] * n for k, n in counts.items()))
    assert s["prefill_peak_bytes_planned_rank"] == s["weights_bytes"] + s["rank_cache_bytes_at_ctx"] + s["workspace_bytes_planned"]


def test_stage_script_stops_the_prefill_at_its_deadline_and_says_so(tmp_path):
    out = tmp_path / "stage.jsonl"
    done = _run(["docs/bench/issue17_stage.py", str(out), "--preset", "tiny", "--ctx", "2000", "--chunk", "64",
                 "--tile", "16", "--decode-steps", "1", "--prefill-deadline-s", "0"])
    assert done.returncode == 0, done.stderr
    r = _records(out)
    assert not r["prefill"]["complete"] and r["prefill"]["tokens"] == 64
    assert r["summary"]["prefill_tokens_measured"] == 64


@pytest.fixture(scope="module")
def random_weights_dir(tmp_path_factory):
    """A tiny random-weights model (official format made in memory) with a tokenizer, as the GPU run's."""
    from tessera.engine.tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("rw"), "tiny", seed=2, fmt="official", in_memory=True)


@pytest.mark.parametrize("transport", [None, "collective"])
def test_serve_script_reports_prefill_decode_and_every_ranks_memory(tmp_path, random_weights_dir, transport):
    """`serve --world 2` on random in-memory weights, over HTTP; collective = NCCL's transport, forced on the ring."""
    out = tmp_path / "serve.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TESSERA_PARALLEL_TRANSPORT")}
    if transport:
        env["TESSERA_PARALLEL_TRANSPORT"] = transport
    done = _run(["docs/bench/issue17_serve_1m.py", str(out), "--model", str(random_weights_dir), "--world", "2",
                 "--prompt-tokens", "150", "--max-tokens", "4", "--chunk", "32", "--tile", "8"], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    r = _records(out)
    assert r["request"]["prompt_tokens"] == 150 and r["request"]["completion_tokens"] == 4
    assert r["request"]["prefill_s"] > 0 and r["request"]["decode_ms_per_token"] > 0
    memory = r["memory"]["bytes"]
    assert memory["rank1_mlx_peak"] > 0 and memory["mlx_peak"] > 0 and memory["rank1_weights"] > 0
    assert r["stopped"]["exit_code"] == 0
    log = Path(str(out) + ".serve.log").read_text()
    assert f"moves streams and steps by {transport or 'p2p'}" in log


def test_check_parallel_on_random_in_memory_weights_is_exact(random_weights_dir):
    """Each rank makes only its layers' weights, and they are the one process's: Δ = 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TESSERA_PARALLEL_TRANSPORT")}
    done = _run(["-m", "tessera.engine.tools.commands", "check", "parallel", "--model", str(random_weights_dir), "--world", "2",
                 "--tokens", "100", "--chunk", "32", "--tile", "8", "--decode", "2", "--json"], env=env)
    report = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 0 and report["passed"], report
    assert report["max_abs_diff"] == 0.0 and report["differing_selections"] == 0
