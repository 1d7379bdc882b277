"""docs/bench/issue14_decode_host.py (the H200 script for a decode step's host cost) runs by path on the CPU
at tiny sizes — the code path the GPU runs — and reports what its docstring promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.tools.make_model import make_model

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})


def test_decode_host_script_measures_both_paths_with_the_switch_on_and_off(tmp_path):
    model_dir = make_model(tmp_path / "model", "tiny", seed=4, with_tokenizer=False, **OVERRIDES)
    out = tmp_path / "host.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # by path: the script finds its checkout itself
    done = subprocess.run([sys.executable, str(ROOT / "docs/bench/issue14_decode_host.py"), str(model_dir), str(out),
                           "--ctx", "100", "--chunk", "32", "--tile", "8", "--steps", "3", "--cache-fill", "random"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
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
