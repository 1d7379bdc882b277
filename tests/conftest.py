"""Suite-wide hooks: the tests import this checkout as `tessera.*` whether or not it is installed
(tests/support/source_tree.py); in the strict run (TESSERA_STRICT_SKIPS=1, set by .ci/run) a skip that is not on
tests/skip_allowlist.txt fails the session (tests/support/skip_policy.py)."""

from __future__ import annotations

import os

import pytest

from tests.support.skip_policy import STRICT_ENV, load_allowlist, unexpected_skips
from tests.support.source_tree import use_source_tree

use_source_tree()  # before any test module imports `tessera.*`; subprocesses inherit it through PYTHONPATH

_skipped: list[tuple[str, str]] = []


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The byte-level tokenizer the scripted-runner servers share (tests/server_harness.py), trained once."""
    from tests.server_harness import make_tokenizer  # web imports only for the tests that ask for it

    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):  # an expected failure is not a skip
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(STRICT_ENV) != "1":
        return
    unexpected = unexpected_skips(_skipped, load_allowlist())
    if unexpected:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{len(unexpected)} skipped tests are not on tests/skip_allowlist.txt ({STRICT_ENV}=1):"]
        lines += [f"  {node_id}: {reason}" for node_id, reason in unexpected]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
