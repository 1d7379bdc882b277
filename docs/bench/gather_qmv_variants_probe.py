"""kernels/gather_qmv.py alone at a decode batch's pair counts: the 16-entry-table kernel and its tensor-core
variant (`gather_qmv_mma_kernel`), at V4 Flash's expert shapes (256 experts, mxfp4, up = 4096 -> 2048 and down =
2048 -> 4096, bf16 rows), top-6 routing drawn uniformly (a random-weight checkpoint's router) or skewed (a fifth of the experts
drawn 4× as often, as docs/bench/issue14_moe_parts.py). One process, the arms in A B … B A order; ms per call
(the median of `--repeat` timings of `--calls` calls each), and the distinct experts' bytes over that time. One
JSON line per measurement to OUT. Off CUDA the kernels' references stand in (`--small`: a smoke run).

  python docs/bench/gather_qmv_variants_probe.py OUT.jsonl [--small] [--uniform-only]

Session 29's raw files came from earlier forms of this script: at commit 88072f8 (gather_qmv_grouped_probe.py; a
grouped kernel and an L2 prefetch, docs/bench/session29-h200-grouped-probe.jsonl) and at 052ec31 (a byte-table
kernel, session29-h200-byte-table-probe.jsonl); those kernels were removed.

Under a profiler, each arm once at 96 pairs (up), between cuProfilerStart and cuProfilerStop:

  ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
      --section WarpStateStats --csv python docs/bench/gather_qmv_variants_probe.py OUT.jsonl --profile
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.probe_io import jsonl_emitter  # noqa: E402
from tessera.kernels import gather_qmv  # noqa: E402
from tessera.kernels.cuda import on_cuda  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K = 256, 4096, 2048, 6  # --small: 16, 1024, 1024
ARMS = {"table": None, "mma": {}, "mma_rows64": {"rows": 64}, "mma_warps8": {"warps": 8}, "mma_unroll2": {"unroll": 2},
        "mma_rows16": {"rows": 16}}  # arm -> gather_qmv_mma_kernel's block shape (None: the table kernel)


def _experts(out_dim: int, in_dim: int) -> tuple[mx.array, mx.array]:
    w = mx.random.normal((EXPERTS, out_dim, in_dim), dtype=mx.bfloat16) * 0.02
    values, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    mx.eval(values, scales)
    return values, scales


def _routing(rng: np.random.Generator, tokens: int, skewed: bool) -> np.ndarray:
    """[tokens * TOP_K] experts, each token's TOP_K distinct."""
    weights = np.ones(EXPERTS)
    if skewed:
        weights[: EXPERTS // 5] = 4.0
    p = weights / weights.sum()
    return np.concatenate([rng.choice(EXPERTS, TOP_K, replace=False, p=p) for _ in range(tokens)]).astype(np.uint32)


def _call(arm: str, x: mx.array, values: mx.array, scales: mx.array, experts: mx.array, rows_per_x: int) -> mx.array:
    """One arm's call on x [P / rows_per_x, K] (up: a token's row read by its TOP_K pairs, as the engine runs it);
    off CUDA the reference stands in (a smoke run of this script)."""
    if not on_cuda():
        return gather_qmv.gather_qmv_reference(x, values, scales, experts, rows_per_x)
    if ARMS[arm] is not None:
        return gather_qmv.gather_qmv_mma_kernel(x, values, scales, experts, rows_per_x, **ARMS[arm])
    gather_qmv.set_mma_enabled(False)
    return gather_qmv.gather_qmv_kernel(x, values, scales, experts, rows_per_x)


def _ms(run, calls: int, repeat: int) -> float:
    for _ in range(3):
        mx.eval([run() for _ in range(calls)])
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval([run() for _ in range(calls)])
        times.append((time.perf_counter() - start) * 1000 / calls)
    return statistics.median(times)


def rounds(emit, calls: int, repeat: int, skew_too: bool) -> None:
    rng = np.random.default_rng(0)
    shapes = {"up": _experts(INTER, HIDDEN), "down": _experts(HIDDEN, INTER)}
    bytes_per_expert = {name: v.nbytes // EXPERTS + s.nbytes // EXPERTS for name, (v, s) in shapes.items()}
    for skewed in (False, True) if skew_too else (False,):
        for tokens in (1, 8, 16):
            flat = _routing(rng, tokens, skewed)
            experts = mx.array(flat)
            distinct = len(set(flat.tolist()))
            for name, (values, scales) in shapes.items():
                k = values.shape[2] * 8
                rows_per_x = TOP_K if name == "up" else 1  # up reads a token's row; down a row per pair
                x = mx.random.normal((flat.size // rows_per_x, k), dtype=mx.bfloat16)
                mx.eval(x)
                order = list(ARMS) + list(ARMS)[::-1]
                distance = arm_distance(x, values, scales, experts, rows_per_x)
                if distance is not None:
                    emit("bits", shape=name, tokens=tokens, **distance)
                for arm in order:
                    ms = _ms(lambda: _call(arm, x, values, scales, experts, rows_per_x), calls, repeat)
                    emit("op", arm=arm, shape=name, skewed=skewed, tokens=tokens, pairs=int(flat.size), distinct=distinct,
                         ms=ms, distinct_tb_per_s=distinct * bytes_per_expert[name] / ms / 1e9)


def arm_distance(x, values, scales, experts, rows_per_x) -> dict | None:
    """How far each arm is from the reference here (max |arm - ref|, max |ref|) and whether the two arms' bits
    are equal (they need not be: the tensor cores sum in another order); None off CUDA."""
    if not on_cuda():
        return None
    a = _call("table", x, values, scales, experts, rows_per_x).astype(mx.float32)
    b = _call("mma", x, values, scales, experts, rows_per_x).astype(mx.float32)
    ref = gather_qmv.gather_qmv_reference(x, values, scales, experts, rows_per_x).astype(mx.float32)
    return {"table_max_abs_error": mx.abs(a - ref).max().item(), "mma_max_abs_error": mx.abs(b - ref).max().item(),
            "max_abs_ref": mx.abs(ref).max().item(), "same_bits": mx.array_equal(a, b).item()}


def profile_once() -> None:
    """Each arm once at 16 tokens (up), inside the profiler's range."""
    driver = ctypes.CDLL("libcuda.so.1")
    flat = _routing(np.random.default_rng(1), 16, skewed=False)
    experts = mx.array(flat)
    values, scales = _experts(INTER, HIDDEN)
    x = mx.random.normal((16, HIDDEN), dtype=mx.bfloat16)
    mx.eval(x)
    for arm in ("table", "mma"):  # compiled and warm before the range
        mx.eval(_call(arm, x, values, scales, experts, TOP_K))
    mx.synchronize()
    driver.cuProfilerStart()
    for arm in ("table", "mma"):
        mx.eval(_call(arm, x, values, scales, experts, TOP_K))
        mx.synchronize()
    driver.cuProfilerStop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--small", action="store_true", help="16 experts of 1024 -> 1024 (a smoke run)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--profile", action="store_true", help="each arm once, for ncu")
    p.add_argument("--uniform-only", action="store_true", help="skip the skewed routing")
    args = p.parse_args()
    if args.small:
        global EXPERTS, HIDDEN, INTER
        EXPERTS, HIDDEN, INTER = 16, 1024, 1024
    if args.profile:
        profile_once()
        return
    rounds(jsonl_emitter(args.out), args.calls, args.repeat, not args.uniform_only)


if __name__ == "__main__":
    main()
