"""A docs/bench script run the way the H200 runs it — by path, in its own process — on a tiny model with every
attention kind, for the tests that check a script does what its docstring promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.tools.make_model import make_model

ROOT = Path(__file__).resolve().parents[2]
TINY_OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})


def tiny_model(directory: Path) -> Path:
    """A 4-layer tiny checkpoint: a window layer, CSA and HCA layers."""
    return make_model(directory, "tiny", seed=4, with_tokenizer=False, **TINY_OVERRIDES)


def run_bench_script(script: str, model_dir: Path, out: Path, *options: str) -> list[dict]:
    """docs/bench/`script` MODEL OUT OPTIONS by path, without PYTHONPATH (a script finds its checkout itself);
    it must succeed. -> OUT's JSON lines."""
    return run_probe_script(script, out, *options, model_dir=model_dir)


def run_probe_script(script: str, out: Path, *options: str, model_dir: Path | None = None) -> list[dict]:
    """docs/bench/`script` [MODEL] OUT OPTIONS by path, from OUT's folder, without PYTHONPATH; a probe that
    needs no model takes OUT first. It must succeed. -> OUT's JSON lines."""
    args = ([] if model_dir is None else [str(model_dir)]) + [str(out), *options]
    _run(script, args, out.parent)
    return [json.loads(line) for line in out.read_text().splitlines()]


def run_printing_script(script: str, model_dir: Path, *options: str) -> list[dict]:
    """docs/bench/`script` MODEL OPTIONS for a script that prints its JSON lines instead of writing a file."""
    printed = _run(script, [str(model_dir), *options], model_dir.parent)
    return [json.loads(line) for line in printed.splitlines() if line.startswith("{")]


def _run(script: str, args: list[str], cwd: Path) -> str:
    """The script by path, in its own process, from `cwd`, without PYTHONPATH (a script finds its checkout
    itself); it must succeed. -> its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(ROOT / "docs/bench" / script), *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout
