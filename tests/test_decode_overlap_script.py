"""docs/bench/issue14_decode_overlap.py (the H200 script behind docs/BENCHMARKS.md "Session 10") runs by path
on the CPU at tiny sizes — the code path the GPU runs — and reports every arm at both batch sizes, in the
alternating order its docstring promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.tools.make_model import make_model

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})


def test_overlap_script_times_every_arm_in_alternating_rounds(tmp_path):
    model_dir = make_model(tmp_path / "model", "tiny", seed=4, with_tokenizer=False, **OVERRIDES)
    out = tmp_path / "overlap.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # by path: the script finds its checkout itself
    done = subprocess.run([sys.executable, str(ROOT / "docs/bench/issue14_decode_overlap.py"), str(model_dir), str(out),
                           "--ctx", "100", "--batch", "3", "--chunk", "32", "--tile", "8", "--steps", "3",
                           "--arms", "serial", "serving_overlap", "--rounds", "1"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    rounds = [(r["arm"], r["batch"]) for r in rows if r["what"] == "decode"]
    assert rounds == [(arm, b) for b in (1, 3) for arm in ("serial", "serving_overlap", "serving_overlap", "serial")]
    assert all(len(r["step_ms"]) >= 2 and r["step_ms_median"] > 0 for r in rows if r["what"] == "decode")
    summary = rows[-1]
    assert summary["what"] == "summary"
    assert {"serial_b1_step_ms", "serving_overlap_b3_step_ms", "serial_ratio_b3_over_b1"} <= set(summary)
