"""Warm decode steps, and only they, under a profiler: B sequences at CTX (random cache rows), four warm
greedy steps, then `--steps` steps (default 1) between `cuProfilerStart` and `cuProfilerStop` (CUDA's driver
API), so `ncu --profile-from-start off` sees those steps' kernels alone. docs/BENCHMARKS.md, "Session 14 on the
H200".

  ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
      python docs/bench/ncu_decode_step.py MODEL --ctx 16384 --batch 16 > OUT.csv

With nsys, the CUDA API calls of 16 steady steps (graph instantiations against updates, managed allocations,
host-to-device copies), "Session 18 on the H200":

  nsys profile --capture-range=cudaProfilerApi --trace=cuda -o OUT \\
      python docs/bench/ncu_decode_step.py MODEL --ctx 16384 --batch 16 --steps 16
  nsys stats --report cuda_api_sum --format csv OUT.nsys-rep
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.probe_io import load_probe_model  # noqa: E402
from tessera.engine.model.deepseek_v4 import Segment  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled  # noqa: E402

WARM_STEPS = 4  # first use compiles kernels and traces the compiled step parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=1, help="steps between cuProfilerStart and cuProfilerStop")
    args = p.parse_args()
    driver = ctypes.CDLL("libcuda.so.1")
    model = load_probe_model(args.model, as_loaded=True)
    caches = [_filled(model, args.ctx, b, DecodeOptions(chunk=4096, tile=1024, cache_fill="random"))
              for b in range(args.batch)]

    def step() -> None:
        logits = mx.concatenate(model.forward([Segment(c, [1]) for c in caches]))
        mx.eval(mx.argmax(logits, axis=-1), [c.arrays() for c in caches])

    for _ in range(WARM_STEPS):
        step()
    mx.synchronize()
    driver.cuProfilerStart()
    for _ in range(args.steps):
        step()
    mx.synchronize()
    driver.cuProfilerStop()


if __name__ == "__main__":
    main()
