"""What an array made from host values costs the host, made anew against taken from kernels/host_arrays.py's
cache, after device ops have freed buffers of its size (docs/ARCHITECTURE.md "Host-made arrays").

python docs/bench/host_array_cost.py OUT.jsonl [--sizes 2 16 64] [--reps 200] [--rounds 2]

For each size n (int32 values: 8, 64, 256 bytes) and arm, in the order fresh cached cached fresh (--rounds
times), `--reps` times: a device op makes and frees an int32 array of n values (so MLX's buffer cache holds a
device buffer of that size), then the host values are made into an array, timed (`make_us`), and used by a
device op that is waited for (`use_us`: includes any page migration the first device read of it costs).
- fresh: `mx.array(values)`, what a step did before kernels/host_arrays.py;
- cached: `host_array(values)` of the same values, the cache's hit.
On CUDA, MLX 0.32 puts a host array of more than 8 bytes in unified memory and, handed a cached device
buffer, first moves that buffer to unified memory (allocation, synchronous copy, free); arrays of 8 bytes
or less come from a pool of their own. On the CPU both arms are a host copy. One JSON line per round, with
`new_arrays`: how many reps got another array object than the rep before (fresh: all but the first; cached: 0).
"""

from __future__ import annotations

import argparse
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
from tessera.kernels.host_arrays import host_array  # noqa: E402

ARMS = ("fresh", "cached")


def timed_round(arm: str, n: int, reps: int) -> tuple[list[float], list[float], int]:
    """-> (µs to make the array, µs for a device op reading it to finish), one each per rep, and how many reps
    got another array object than the rep before (fresh: every one; cached: none once the value is in)."""
    device_values = mx.arange(n, dtype=mx.int32)
    values = np.arange(n, dtype=np.int32) * 3
    make, use, new_arrays, previous = [], [], 0, None
    for _ in range(reps):
        freed = device_values * 2 + 1  # a device op's output of n int32, freed at once: MLX caches its buffer
        mx.eval(freed)
        del freed
        start = time.perf_counter()
        made = mx.array(values) if arm == "fresh" else host_array(values)
        made_at = time.perf_counter()
        mx.eval(made + device_values)
        make.append((made_at - start) * 1e6)
        use.append((time.perf_counter() - made_at) * 1e6)
        new_arrays += previous is not None and made is not previous
        previous = made
    return make, use, new_arrays


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 16, 64], help="int32 values per array")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2, help="fresh cached cached fresh sequences per size")
    args = p.parse_args()
    emit = jsonl_emitter(args.out)
    for n in args.sizes:
        timed_round("fresh", n, 10)  # warm: first-use compilation of the device ops
        medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for arm in (ARMS + ARMS[::-1]) * args.rounds:
            make, use, new_arrays = timed_round(arm, n, args.reps)
            medians[arm].append(statistics.median(make))
            emit("host_array", arm=arm, values=n, nbytes=4 * n, make_us_median=statistics.median(make),
                 use_us_median=statistics.median(use), make_us_p90=sorted(make)[int(0.9 * len(make))],
                 new_arrays=new_arrays)
        emit("summary", values=n, nbytes=4 * n, **{f"{arm}_make_us": statistics.median(v) for arm, v in medians.items()})


if __name__ == "__main__":
    main()
