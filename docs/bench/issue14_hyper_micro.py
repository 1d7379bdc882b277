"""One layer's hyper-connection work at decode size (2 collapses + 2 expands, T rows), compiled vs
plain (kernels/shapeless.py) in rounds on off off on in one process: the per-op overhead the
compilation removes, without the matmuls that dominate a CPU decode step.

python docs/bench/issue14_hyper_micro.py OUT.jsonl [--rows 1] [--width 4096] [--reps 200] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from tessera.kernels.shapeless import set_compile_enabled
from tessera.engine.model.hyper import HyperWeights, expand, hyper_weights

HC, ITERS, EPS = 4, 20, 1e-6


def layer_step(streams, block_out, w_attn, w_ffn):
    post, comb, collapsed = hyper_weights(streams, w_attn, ITERS, EPS, EPS)
    streams = expand(block_out + collapsed, streams, post, comb)
    post, comb, collapsed = hyper_weights(streams, w_ffn, ITERS, EPS, EPS)
    return expand(block_out + collapsed, streams, post, comb)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    mixes = (2 + HC) * HC
    weights = [HyperWeights((mx.random.normal((mixes, HC * args.width)) * 0.02).astype(dtype),
                            mx.random.normal((mixes,)).astype(dtype), mx.random.normal((3,)).astype(dtype)) for _ in range(2)]
    streams = mx.random.normal((args.rows, HC, args.width)).astype(dtype)
    block_out = mx.random.normal((args.rows, args.width)).astype(dtype)
    mx.eval(weights[0].fn, weights[1].fn, streams, block_out)
    with open(args.out, "w") as out:
        for enabled in (True, False, False, True):
            set_compile_enabled(enabled)
            mx.eval(layer_step(streams, block_out, *weights))  # warm-up (traces once)
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                mx.eval(layer_step(streams, block_out, *weights))
                times.append((time.perf_counter() - start) * 1000)
            row = {"compile": enabled, "rows": args.rows, "width": args.width, "dtype": args.dtype, "device": str(mx.default_device()),
                   "reps": args.reps, "layer_ms_median": statistics.median(times), "layer_ms_min": min(times)}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
