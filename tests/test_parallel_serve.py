"""`tessera serve --world 2`: rank 0 serves HTTP and the first layers, a follower process the rest. Answers
equal one process's; a follower killed mid-life takes the server down within seconds (no hang); SIGTERM
stops every rank; a follower whose rank 0 dies exits too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tessera.engine.parallel.serving import RANK_LOST_EXIT_CODE
from tessera.engine.parallel.transport import TRANSPORT_ENV
from tessera.engine.tools.make_model import make_model
from tests.server_harness import free_port

# The second prompt is longer than the chunk (32): its prefill takes several steps.
PROMPTS = ["hello world, this is a test of the pipeline", "a second prompt, longer than one chunk of thirty-two tokens " * 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=4)


@contextmanager
def _server(model_dir: Path, world: int, log: Path, transport: str | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    env = dict(os.environ)  # inherits how this process imports tessera (tests/conftest.py)
    env.pop(TRANSPORT_ENV, None)
    if transport is not None:  # forced (what NCCL gets); by default the ring backend uses send/recv
        env[TRANSPORT_ENV] = transport
    env.pop("LD_PRELOAD", None)  # exactness: the same BLAS in every process
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tessera.server.cli", "serve", "--model", str(model_dir), "--world", str(world),
                                 "--port", str(port), "--prefill-chunk", "32", "--indexer-tile", "8"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, _wait_ready(proc, port, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> str:
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "server not ready in 120 s:\n" + log.read_text()
        try:
            if httpx.get(base + "/ready", timeout=1).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def _follower_pid(log: Path) -> int:
    return int(re.search(r"started rank 1 \(pid (\d+)\)", log.read_text()).group(1))


def _complete(base: str, prompt: str) -> tuple[list[str], list[float]]:
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    reply = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    lp = reply.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def _assert_same(answers, expected) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(answers, expected, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) <= 1e-5


def _memory_metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^tessera_memory_bytes\{kind="(\w+)"[^}]*\} (\S+)$', text, re.M)}


def _whole_weights_bytes(model_dir: Path) -> int:
    from tessera.engine.model.loader import load_model

    return sum(w.nbytes for w in load_model(model_dir).weights.values())


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture(scope="module")
def expected(model_dir, tmp_path_factory):
    """One process's greedy answers (tokens, logprobs) to PROMPTS."""
    with _server(model_dir, 1, tmp_path_factory.mktemp("world1") / "serve.log") as (_, base):
        return [_complete(base, p) for p in PROMPTS]


@pytest.mark.parametrize("transport", ["p2p", "collective"])
def test_two_ranks_answer_as_one_process_and_stop_together(model_dir, expected, tmp_path, transport):
    log = tmp_path / "world2.log"
    with _server(model_dir, 2, log, transport) as (proc, base):
        _assert_same([_complete(base, p) for p in PROMPTS], expected)
        # Both at once: steps that mix one request's decodes with the other's prefill chunk. The reference
        # BLAS is row-invariant, so each request's logits do not depend on what shares its step.
        with ThreadPoolExecutor(2) as pool:
            _assert_same(list(pool.map(lambda p: _complete(base, p), PROMPTS)), expected)
        memory = _memory_metrics(base)  # per rank, as of the last step
        assert memory["rank1_weights"] > 0 and memory["rank1_mlx_peak"] >= memory["rank1_weights"]
        assert memory["weights"] + memory["rank1_weights"] == pytest.approx(_whole_weights_bytes(model_dir), abs=1024)
        follower = _follower_pid(log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not _is_running(follower)
    assert "all ranks stopped" in log.read_text()
    for rank in (0, 1):
        assert f"rank {rank} moves streams and steps by {transport}" in log.read_text()


def test_under_mlx_launch_every_rank_runs_tessera_serve(model_dir, expected, tmp_path):
    """`mlx.launch … tessera serve --world 2`: the launcher made the world; rank 0 serves, rank 1 follows."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.is_file():
        pytest.skip("mlx.launch is not installed beside this python")
    port, log = free_port(), tmp_path / "launch.log"
    env = dict(os.environ)  # inherits how this process imports tessera (tests/conftest.py)
    env.pop("LD_PRELOAD", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(launcher), "--hosts", "127.0.0.1,127.0.0.1", "--backend", "ring", "--python",
                                 sys.executable, "--", "-m", "tessera.server.cli", "serve", "--model", str(model_dir), "--world", "2",
                                 "--port", str(port), "--prefill-chunk", "32", "--indexer-tile", "8"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                # mlx.launch forwards its stdin to every rank: at EOF (/dev/null, a closed
                                # stdin) its select loop spins a core, which starved this 2-core box's ranks.
                                # An open pipe with no data keeps it polling.
                                stdin=subprocess.PIPE)
    try:
        base = _wait_ready(proc, port, log)
        _assert_same([_complete(base, p) for p in PROMPTS], expected)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the launcher's terminal: every rank gets it
        proc.wait(timeout=60)
        assert "rank 1 holds layers 2..3" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_killed_follower_takes_the_server_down_within_seconds(model_dir, tmp_path):
    log = tmp_path / "serve.log"
    with _server(model_dir, 2, log) as (proc, base):
        _complete(base, PROMPTS[0])
        os.kill(_follower_pid(log), signal.SIGKILL)
        started = time.monotonic()
        code = proc.wait(timeout=10)
        assert time.monotonic() - started < 5
    assert code == RANK_LOST_EXIT_CODE
    assert "rank 1 exited (code -9)" in log.read_text()


def test_a_follower_exits_when_rank_0_dies(model_dir, tmp_path):
    log = tmp_path / "serve.log"
    with _server(model_dir, 2, log) as (proc, _):
        follower = _follower_pid(log)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5
        while _is_running(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _is_running(follower), "the follower outlived rank 0"
