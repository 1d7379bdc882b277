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
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-u", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _records(path: Path) -> dict[str, dict]:
    return {r["event"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("rank, kinds", [(0, {"window", "csa"}), (1, {"hca", "csa"})])
def test_stage_script_measures_one_rank_and_extrapolates_by_layer_kind(tmp_path, rank, kinds):
    out = tmp_path / "stage.jsonl"
    done = _run(["docs/bench/issue17_stage.py", str(out), "--preset", "tiny", "--rank", str(rank), "--ctx", "300",
                 "--chunk", "64", "--tile", "16", "--decode-steps", "3"])
    assert done.returncode == 0, done.stderr
    r = _records(out)
    assert r["start"]["layers"] == ([0, 2] if rank == 0 else [2, 4])
    assert (r["weights"]["vocab_bytes"] > 0) == (rank == 0)
    assert {"mxfp8", "mxfp4"} <= set(r["weights"]["bytes_by_format"])  # official format, made in memory
    assert r["prefill"]["complete"] and r["prefill"]["tokens"] == 300
    assert set(r["prefill"]["kind_seconds"]) == kinds
    assert r["decode"]["ctx"] == 300 and len(r["decode"]["step_ms"]) == 3
    s = r["summary"]
    assert s["kinds_not_measured"] == []
    assert s["rank_prefill_seconds_estimate"] == pytest.approx(sum(r["prefill"]["kind_seconds"].values()))
    assert s["prefill_peak_bytes_planned_rank"] == s["weights_bytes"] + s["rank_cache_bytes_at_ctx"] + s["workspace_bytes_planned"]


def test_stage_script_stops_the_prefill_at_its_deadline_and_says_so(tmp_path):
    out = tmp_path / "stage.jsonl"
    done = _run(["docs/bench/issue17_stage.py", str(out), "--preset", "tiny", "--ctx", "2000", "--chunk", "64",
                 "--tile", "16", "--decode-steps", "1", "--prefill-deadline-s", "0"])
    assert done.returncode == 0, done.stderr
    r = _records(out)
    assert not r["prefill"]["complete"] and r["prefill"]["tokens"] == 64
    assert r["summary"]["prefill_tokens_measured"] == 64
