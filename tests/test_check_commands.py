"""`tessera check kernels|reference|consistency` fail (exit 1) when a threshold is exceeded, pass (exit 0)
within their documented defaults, and say which flag to change; `check kernels` exits 2 where it cannot run.

The verdict logic runs on reports (a real H200 report from docs/bench, and edits of it); the real CPU runs of
`check consistency` and `check reference` are in tests/equivalence."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.engine.tools import commands, consistency, reference_check
from tessera.engine.tools.check_limits import ConsistencyLimits
from tessera.engine.tools.consistency import ConsistencyReport
from tessera.engine.tools.reference_check import ReferenceReport
from tessera.kernels import device_checks

ROOT = Path(__file__).resolve().parents[1]
H200_KERNEL_REPORT = json.loads((ROOT / "docs" / "bench" / "h200-check-kernels.json").read_text())


def run_cli(capsys, *argv: str) -> tuple[int, dict, str]:
    status = commands.main(["check", *argv, "--json"])
    out, err = capsys.readouterr()
    return status, json.loads(out.strip().splitlines()[-1]), err


# ---- check kernels -------------------------------------------------------------------------------------------


def with_kernel_report(monkeypatch, report: dict) -> None:
    monkeypatch.setattr(device_checks, "check_indexer_kernel", lambda: copy.deepcopy(report))


def test_check_kernels_passes_the_measured_h200_report(monkeypatch, capsys):
    with_kernel_report(monkeypatch, H200_KERNEL_REPORT)
    status, report, _ = run_cli(capsys, "kernels")
    assert status == 0 and report["passed"] and report["failures"] == []


@pytest.mark.parametrize("edit,flag_or_words", [
    (lambda r: r["random"].update(max_rel_diff=3e-5), "--max-rel-diff"),
    (lambda r: r["ties"].update(max_rel_diff=1e-9), "ties: max_rel_diff"),
    (lambda r: r["random"].update(differing_selection_rows=1), "--max-differing-rows"),
    (lambda r: r["ties"].update(masks_equal=False), "masks other rows"),
    (lambda r: r.update(tile_invariant=False), "depend on the tile"),
    (lambda r: r["topk_kernel"]["ties"].update(differing_rows=2), "top-k kernel, ties"),
])
def test_check_kernels_fails_on_each_exceeded_threshold(monkeypatch, capsys, edit, flag_or_words):
    report = copy.deepcopy(H200_KERNEL_REPORT)
    edit(report)
    with_kernel_report(monkeypatch, report)
    status, printed, err = run_cli(capsys, "kernels")
    assert status == 1 and not printed["passed"]
    assert flag_or_words in err and len(printed["failures"]) == 1


def test_check_kernels_thresholds_are_flags(monkeypatch, capsys):
    report = copy.deepcopy(H200_KERNEL_REPORT)
    report["random"]["max_rel_diff"] = 3e-5
    with_kernel_report(monkeypatch, report)
    assert run_cli(capsys, "kernels", "--max-rel-diff", "1e-4")[0] == 0


def test_check_kernels_without_cuda_exits_2_and_says_so():
    """The real command on this machine: no CUDA device, nothing checked — never a silent pass."""
    if device_checks.indexer_cuda.on_cuda():
        pytest.skip("has a CUDA device: the kernels run (tests/test_kernels_cuda.py)")
    out = subprocess.run([sys.executable, "-m", "tessera.engine.tools.commands", "check", "kernels", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2 and "no CUDA device" in out.stderr


# ---- check consistency -----------------------------------------------------------------------------------------


def consistency_report(**changes) -> ConsistencyReport:
    fields = dict(ctx=301, chunk=64, tile=16, decode=8, max_abs_diff=0.0, untiled_max_abs_diff=0.0,
                  whole_sequence_max_abs_diff=0.0, differing_selections=0, compared_selections=600)
    fields.update(changes)
    return ConsistencyReport(**fields)


@pytest.mark.parametrize("changes,flag", [
    (dict(untiled_max_abs_diff=1e-7), "--max-untiled-diff"),
    (dict(whole_sequence_max_abs_diff=0.078), "--max-whole-sequence-diff"),
    (dict(differing_selections=6), "--max-differing-selections"),
])
def test_check_consistency_fails_past_each_threshold_and_passes_when_raised(monkeypatch, capsys, changes, flag):
    args = ["consistency", "--model", "unused", "--ctx", "301", "--chunk", "64", "--tile", "16"]
    monkeypatch.setattr(consistency, "check_consistency", lambda *a, **k: consistency_report())
    assert run_cli(capsys, *args)[0] == 0
    monkeypatch.setattr(consistency, "check_consistency", lambda *a, **k: consistency_report(**changes))
    status, printed, err = run_cli(capsys, *args)
    assert status == 1 and flag in err and not printed["passed"]
    assert run_cli(capsys, *args, flag, "10")[0] == 0


def test_consistency_defaults_are_bit_identity_for_tiling():
    limits = ConsistencyLimits()
    assert limits.untiled_diff == 0.0 and limits.differing_selections == 0
    assert consistency.consistency_failures(consistency_report(whole_sequence_max_abs_diff=5e-5), limits) == []


# ---- check reference -------------------------------------------------------------------------------------------


def reference_report(**changes) -> ReferenceReport:
    fields = dict(num_tokens=150, chunk=37, tile=37, decode=5, max_abs_diff=2e-6, prefill_max_abs_diff=2e-6,
                  decode_max_abs_diff=1e-6, top1_agreement=1.0, worst_position=3)
    fields.update(changes)
    return ReferenceReport(**fields)


@pytest.mark.parametrize("changes,flag", [
    (dict(max_abs_diff=3e-4), "--max-abs-diff"),
    (dict(top1_agreement=0.99), "--min-top1-agreement"),
])
def test_check_reference_fails_past_each_threshold(monkeypatch, capsys, changes, flag):
    args = ["reference", "--model", "unused", "--tokens", "150"]
    monkeypatch.setattr(reference_check, "check_reference", lambda *a, **k: reference_report())
    assert run_cli(capsys, *args)[0] == 0
    monkeypatch.setattr(reference_check, "check_reference", lambda *a, **k: reference_report(**changes))
    status, printed, err = run_cli(capsys, *args)
    assert status == 1 and flag in err and printed["failures"]
