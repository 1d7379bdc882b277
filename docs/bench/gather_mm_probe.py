"""MLX CUDA's `gather_mm` / `gather_qmm` with M = 1 rows against the CPU, by layout, and their speed at
decode shapes (docs/BENCHMARKS.md, "Session 9": the device-vs-CPU check found layer 0's gathered MoE
wrong on the H200 for a 5-token prompt).

Variants: the weight as a contiguous [E, in, out] array or as the transposed view of an [E, out, in]
one (how moe.py passes it), experts distinct or repeated (groups of more than one row), sorted
(CUTLASS grouped GEMM) or unsorted (gather_mv) indices; gather_qmm (mxfp4) sorted and unsorted.
Each row: max |GPU − CPU| / max |CPU|, the CPU in float32 from the same (rounded) inputs.

  python docs/bench/gather_mm_probe.py OUT.jsonl"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from tessera.engine.tools.device_agreement import rel_diff as rel  # noqa: E402  max |GPU − CPU| / max |CPU|


def gather(x, w_t, experts, sorted_indices):
    return mx.gather_mm(x, w_t, rhs_indices=experts, sorted_indices=sorted_indices)


def accuracy_rows(dtype, num_experts, d_in, d_out, experts_np, seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((len(experts_np), 1, d_in)).astype(np.float32)).astype(dtype)
    w = mx.array((rng.standard_normal((num_experts, d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)).astype(dtype)
    experts = mx.array(experts_np.astype(np.uint32))
    with mx.stream(mx.cpu):
        want = gather(x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2), experts, False)
        mx.eval(want)
    rows = []
    variants = {
        "transposed view, sorted": lambda: gather(x, w.swapaxes(-1, -2), experts, True),
        "contiguous, sorted": lambda: gather(x, mx.contiguous(w.swapaxes(-1, -2)), experts, True),
        "transposed view, unsorted": lambda: gather(x, w.swapaxes(-1, -2), experts, False),
        "contiguous, unsorted": lambda: gather(x, mx.contiguous(w.swapaxes(-1, -2)), experts, False),
    }
    for name, fn in variants.items():
        with mx.stream(mx.gpu):
            got = fn()
            mx.eval(got)
        rows.append({"what": "gather_mm", "variant": name, "dtype": str(dtype), "experts": num_experts,
                     "in": d_in, "out": d_out, "pairs": len(experts_np),
                     "repeats": bool(len(set(experts_np.tolist())) < len(experts_np)), "rel_diff": rel(got, want)})
    if d_in % 32 == 0:
        q = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
        with mx.stream(mx.cpu):
            wq = mx.dequantize(*q[:2], group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
            want_q = gather(x.astype(mx.float32), wq.swapaxes(-1, -2), experts, False)
            mx.eval(want_q)
        for sorted_indices in (True, False):
            with mx.stream(mx.gpu):
                got = mx.gather_qmm(x, q[0], q[1], None, rhs_indices=experts, transpose=True, group_size=32, bits=4,
                                    mode="mxfp4", sorted_indices=sorted_indices)
                mx.eval(got)
            rows.append({"what": "gather_qmm mxfp4", "variant": "sorted" if sorted_indices else "unsorted",
                         "dtype": str(dtype), "experts": num_experts, "in": d_in, "out": d_out,
                         "pairs": len(experts_np), "repeats": bool(len(set(experts_np.tolist())) < len(experts_np)),
                         "rel_diff": rel(got, want_q)})
    return rows


def timing_rows(pairs: int, repeat: int = 50) -> list[dict]:
    """V4 Flash's gate projection (bf16, 256 experts, 4096 -> 2048) at a decode step's pair count."""
    rng = np.random.default_rng(1)
    experts = mx.array(np.sort(rng.choice(256, pairs, replace=pairs > 256)).astype(np.uint32))
    x = mx.array(rng.standard_normal((pairs, 1, 4096)).astype(np.float32)).astype(mx.bfloat16)
    w = (mx.random.normal((256, 2048, 4096)) * 0.02).astype(mx.bfloat16)
    mx.eval(x, w)
    rows = []
    for name, fn in [("transposed view, sorted", lambda: gather(x, w.swapaxes(-1, -2), experts, True)),
                     ("transposed view, unsorted", lambda: gather(x, w.swapaxes(-1, -2), experts, False))] * 2:
        for _ in range(3):
            mx.eval(fn())
        t0 = time.perf_counter()
        for _ in range(repeat):
            mx.eval(fn())
        rows.append({"what": "time", "variant": name, "pairs": pairs, "ms": (time.perf_counter() - t0) * 1e3 / repeat})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    args = p.parse_args()
    rows = []
    rng = np.random.default_rng(3)
    for dtype in (mx.float32, mx.bfloat16):
        for e, d_in, d_out in [(4, 64, 32), (4, 32, 64), (256, 512, 256)]:
            for experts in (np.array([0, 1, 2, 3][: min(e, 4)]), np.array([0, 0, 1, 1, 2, 2, 2, 3, 3, 3]),
                            np.sort(rng.integers(0, e, 96))):
                rows += accuracy_rows(dtype, e, d_in, d_out, experts)
    for pairs in (6, 96, 600):
        rows += timing_rows(pairs)
    with args.out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
