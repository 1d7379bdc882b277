"""Run a bit-exactness test where a row's result cannot depend on the other rows of its matmul.

`make test` preloads Debian's OpenBLAS for speed (Makefile), and OpenBLAS's gemm result for a row depends on
how many rows share the call (docs/BENCHMARKS.md): a sequence batched with others, or prefilled in chunks of
other sizes, then differs in the last bits. MLX's bundled BLAS is row-invariant. A test decorated with
`@row_invariant_blas` therefore reruns itself in a child pytest without LD_PRELOAD when the parent has it,
and fails with the child's output if the child fails; without LD_PRELOAD it simply runs.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 900


def row_invariant_blas(test: Callable) -> Callable:
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if not os.environ.get("LD_PRELOAD"):
            return test(*args, **kwargs)
        node_id = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]  # "path::name[params] (call)"
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTEST_CURRENT_TEST")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node_id],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
        )
        assert child.returncode == 0, f"{node_id} failed without LD_PRELOAD:\n{child.stdout[-6000:]}{child.stderr[-2000:]}"

    return wrapper
