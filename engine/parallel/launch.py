"""Start the ranks of a local world and join this process to it, on MLX's own distributed layer.

`mx.distributed.init` reads its peers from the environment: the ring backend (CPU; Apple machines) a
hostfile of `ip:port` per rank, NCCL (CUDA) rank 0's address and the world size. On one machine we write
those for 127.0.0.1 ourselves, as `mlx.launch` would, so that `tessera check parallel` and
`tessera serve --world N` need no launcher; across machines `mlx.launch` sets the same variables
(docs/PARALLEL.md). Children that die are reported by `RankWatch` within a poll interval.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx

logger = logging.getLogger("tessera.parallel")


@dataclass(frozen=True)
class LocalWorld:
    """Where the ranks of a one-machine world meet: the backend and its rendezvous."""

    size: int
    backend: str  # "ring" (CPU) or "nccl" (CUDA)
    hostfile: str  # ring: JSON [["127.0.0.1:port"], …], one entry per rank
    nccl_port: int

    def env(self, rank: int) -> dict[str, str]:
        """The environment variables rank `rank` needs for `mx.distributed.init(backend)`."""
        env = {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(self.size)}
        if self.backend == "ring":
            env["MLX_HOSTFILE"] = self.hostfile
        else:
            env.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(self.nccl_port), CUDA_VISIBLE_DEVICES=str(rank))
        return env


def default_backend() -> str:
    """NCCL where the default device is a CUDA GPU, the ring backend (TCP) otherwise."""
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        return "nccl"
    return "ring"


def new_local_world(size: int, backend: str | None = None, workdir: Path | None = None) -> LocalWorld:
    backend = backend or default_backend()
    if backend not in ("ring", "nccl"):
        raise ValueError(f"backend {backend!r}: choose 'ring' or 'nccl'")
    ports = _free_ports(size + 1)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="tessera-world-"))
    hostfile = workdir / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports[:size]]))
    return LocalWorld(size, backend, str(hostfile), ports[size])


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def spawn_rank(world: LocalWorld, rank: int, argv: Sequence[str], log_path: Path | None = None) -> subprocess.Popen:
    """Start `python argv…` as rank `rank`; its output goes to `log_path` (default: this process's stderr).
    The rank imports `tessera` as this process does: the same interpreter (an install, editable or not) and the
    same environment (PYTHONPATH, where a source checkout runs uninstalled: README.md)."""
    env = {**os.environ, **world.env(rank)}
    out = open(log_path, "wb") if log_path is not None else None
    return subprocess.Popen([sys.executable, *argv], env=env, stdout=out, stderr=subprocess.STDOUT if out else None)


def join_world(world: LocalWorld, rank: int) -> mx.distributed.Group:
    """Join this process to `world` as `rank` (blocks until every rank has joined)."""
    os.environ.update(world.env(rank))
    return init_group(world.backend)


def launched_world() -> tuple[int, str] | None:
    """(rank, backend) when a launcher such as `mlx.launch` made the world (MLX_RANK is set); None otherwise."""
    if "MLX_RANK" not in os.environ:
        return None
    backend = "nccl" if "NCCL_HOST_IP" in os.environ else "ring" if "MLX_HOSTFILE" in os.environ else "any"
    return int(os.environ["MLX_RANK"]), backend


def init_group(backend: str) -> mx.distributed.Group:
    group = mx.distributed.init(strict=True, backend=backend)
    logger.info("rank %d of %d joined (%s)", group.rank(), group.size(), backend)
    return group


class RankWatch:
    """Polls child ranks; the first that exits while not expected to calls `on_lost(rank, returncode)`."""

    POLL_S = 0.2

    def __init__(self, processes: dict[int, subprocess.Popen], on_lost: Callable[[int, int], None]) -> None:
        self._processes, self._on_lost = processes, on_lost
        self._expected_exit = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-rank-watch", daemon=True)
        self._thread.start()

    def expect_exit(self) -> None:
        self._expected_exit.set()

    def _run(self) -> None:
        while not self._expected_exit.is_set():
            for rank, proc in self._processes.items():
                code = proc.poll()
                if code is not None and not self._expected_exit.is_set():
                    self._on_lost(rank, code)
                    return
            time.sleep(self.POLL_S)


def stop_processes(processes: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Wait up to `grace_s` for each to exit, then terminate (and at last kill) what is left."""
    deadline = time.monotonic() + grace_s
    for proc in processes:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
