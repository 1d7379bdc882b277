"""Operating the server as a new user or an orchestrator would (issue 18): `make serve` stops on SIGTERM, the
startup log names the BLAS in use (and the fix for the slow one), the first start says what it generates."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")

FAKE_SERVER = """#!{python}
import signal, sys, time
from pathlib import Path
out = Path({out!r})
def stop(signum, frame):
    out.write_text("terminated")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
out.write_text("running")
time.sleep(60)
"""


@pytest.mark.skipif(subprocess.run(["which", "make"], capture_output=True).returncode != 0, reason="no make")
def test_sigterm_to_make_serve_stops_the_server(tmp_path: Path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    out = tmp_path / "server-state"
    tessera = venv / "bin" / "tessera"
    tessera.write_text(FAKE_SERVER.format(python=sys.executable, out=str(out)))
    tessera.chmod(0o755)
    (venv / ".installed").touch()  # newer than pyproject.toml: `install` has nothing to do
    make = subprocess.Popen(["make", "-s", "-C", str(REPO), "serve", f"VENV={venv}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not (out.is_file() and out.read_text() == "running"):
            assert time.monotonic() < deadline and make.poll() is None, make.stdout.read() if make.stdout else ""
            time.sleep(0.05)
        os.kill(make.pid, signal.SIGTERM)  # what Docker, systemd and CI do
        deadline = time.monotonic() + 10
        while out.read_text() != "terminated":
            assert time.monotonic() < deadline, "the server did not get the SIGTERM sent to make"
            time.sleep(0.05)
    finally:
        make.kill()
        make.wait(10)


def _blas_report(env_extra: dict[str, str]) -> str:
    code = "from tessera.engine.serving.blas import blas_in_use; print(blas_in_use().describe())"
    env = {**os.environ, **env_extra}  # inherits how this process imports tessera (tests/conftest.py)
    env.pop("LD_PRELOAD", None) if "LD_PRELOAD" not in env_extra else None
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bundled reference BLAS is mlx[cpu] on Linux")
def test_the_startup_log_names_the_slow_blas_and_the_command_that_fixes_it():
    report = _blas_report({})
    if report.startswith("CPU matmuls use OpenBLAS"):
        pytest.skip("this interpreter already runs OpenBLAS")
    assert "reference BLAS" in report
    assert "apt-get install libopenblas0-pthread" in report and f"LD_PRELOAD={OPENBLAS}" in report


@pytest.mark.skipif(not OPENBLAS.is_file(), reason="OpenBLAS is not installed here")
def test_the_startup_log_names_openblas_when_it_is_preloaded():
    report = _blas_report({"LD_PRELOAD": str(OPENBLAS)})
    assert report.startswith("CPU matmuls use OpenBLAS") and "apt-get" not in report


def test_the_first_start_says_what_it_generates_and_where(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    from tessera.engine.tools import default_model

    target = tmp_path / "default-model"
    with caplog.at_level(logging.INFO, logger="tessera.engine.tools.default_model"):
        default_model.ensure_default_model(target)
    text = caplog.text
    assert str(target) in text and "once" in text
    assert "[1/2]" in text and "[2/2]" in text and "ready" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tessera.engine.tools.default_model"):
        default_model.ensure_default_model(target)  # the second start reuses it, quietly
    assert "generating" not in caplog.text
