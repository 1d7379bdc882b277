"""The strict run's skip policy: its parsing and matching, and the conftest hook failing a real pytest session
on a skip that is not allowed (and only then)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.skip_policy import (
    ALLOWLIST_ENV, STRICT_ENV, AllowedSkip, load_allowlist, parse_allowlist, unexpected_skips,
)

ROOT = Path(__file__).resolve().parents[1]


def test_parse_and_match():
    allowed = parse_allowlist("# comment\n\ntests/a.py::* -- needs CUDA\ntests/b.py::test_x[1] -- flaky host\n")
    assert allowed == [AllowedSkip("tests/a.py::*", "needs CUDA"), AllowedSkip("tests/b.py::test_x[1]", "flaky host")]
    skipped = [("tests/a.py::test_k[3-4]", "no cuda"), ("tests/b.py::test_x[1]", "r"), ("tests/b.py::test_x[2]", "r"),
               ("tests/c.py::test_y", "no prometheus")]
    assert unexpected_skips(skipped, allowed) == [("tests/b.py::test_x[2]", "r"), ("tests/c.py::test_y", "no prometheus")]
    assert not AllowedSkip("tests/b.py::test_x[1]", "r").matches("tests/b.py::test_x1")  # brackets are literal


def test_an_entry_without_a_reason_is_an_error():
    with pytest.raises(ValueError, match="line 2"):
        parse_allowlist("tests/a.py::* -- ok\ntests/b.py::test_x\n")


def test_the_repository_allowlist_parses_and_names_existing_files():
    for entry in load_allowlist():
        assert (ROOT / entry.pattern.split("::")[0]).exists(), entry


def run_pytest_on(tmp_path: Path, strict: bool) -> subprocess.CompletedProcess:
    """A real pytest session over two skipping tests in this repo's tests/ folder: one allowed, one not."""
    name = f"test_zz_skip_probe_{os.getpid()}_{int(strict)}.py"
    probe = ROOT / "tests" / name
    allowlist = tmp_path / "allow.txt"
    allowlist.write_text(f"tests/{name}::test_kernels_*_like -- needs CUDA\n")
    probe.write_text("import pytest\n\n"
                     "def test_kernels_cuda_like():\n    pytest.skip('needs CUDA')\n\n"
                     "def test_silently_skipped():\n    pytest.skip('no binary')\n\n"
                     "def test_runs():\n    assert True\n")
    env = {k: v for k, v in os.environ.items() if k not in (STRICT_ENV, "LD_PRELOAD")}
    env[ALLOWLIST_ENV] = str(allowlist)
    if strict:
        env[STRICT_ENV] = "1"
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        probe.unlink()


def test_the_hook_fails_a_strict_session_on_an_unlisted_skip(tmp_path):
    strict = run_pytest_on(tmp_path, strict=True)
    assert strict.returncode == 1, strict.stdout
    assert "1 skipped tests are not on tests/skip_allowlist.txt" in strict.stdout
    assert "test_silently_skipped: " in strict.stdout and "test_kernels_cuda_like" not in strict.stdout.split("not on")[1]
    relaxed = run_pytest_on(tmp_path, strict=False)
    assert relaxed.returncode == 0, relaxed.stdout
