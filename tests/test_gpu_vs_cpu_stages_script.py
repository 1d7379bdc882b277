"""docs/bench/gpu_vs_cpu_stages.py (the probe that found session 9's GPU-vs-CPU difference) runs by path on the
CPU: two recordings of one device agree in every function, and a recording that differs in one function is
named at that function first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs/bench/gpu_vs_cpu_stages.py"


def _run(*args: str, cwd: Path, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env  # by path: it finds its checkout
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=environ)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_stage_recordings_line_up_and_a_differing_function_is_named_first(tmp_path):
    model = tmp_path / "m"
    _run("model", str(model), cwd=tmp_path)
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    _run("record", str(model), str(a), "--device", "cpu", "--length", "5", cwd=tmp_path)
    _run("record", str(model), str(b), "--device", "cpu", "--length", "5", cwd=tmp_path, TESSERA_COMPILE="0")
    same = _run("compare", str(a), str(b), cwd=tmp_path)
    assert "moe._gather_linear#1.0" in same and "past the limit" not in same  # compiled or not: the same bits

    records = dict(np.load(b))
    key = next(k for k in records["order"] if "moe._gather_linear#2" in str(k))
    records[str(key)] = records[str(key)] * 1.5  # the up projection of layer 0's MoE computes something else
    np.savez(b, **records)
    lines = [line for line in _run("compare", str(a), str(b), cwd=tmp_path).splitlines() if "past the limit" in line]
    assert "moe._gather_linear#2.0" in lines[0]
