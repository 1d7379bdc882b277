"""What one graph node costs MLX's CUDA backend, by kind: host time to encode it, device time to run it.

python docs/bench/mlx_encode_cost.py OUT.jsonl [--nodes 600]     # one JSON line per kind; run once per setting:
MLX_USE_CUDA_GRAPHS=0 python docs/bench/mlx_encode_cost.py OUT.jsonl
MLX_MAX_OPS_PER_BUFFER=400 python docs/bench/mlx_encode_cost.py OUT.jsonl

A decode step is host-bound (docs/BENCHMARKS.md, "Session 12 on the H200"): MLX encodes its ~740 nodes in
~4 ms. Each kind here is `--nodes` nodes of one kind on one-row operands, evaluated together: `encode_us`
is the host's time per node (`mx.async_eval` returned), `device_us` the device's (the same nodes queued
behind a spin kernel, so the host has encoded them all before the device starts: arrival − spin, per node).
Kinds: add (an elementwise kernel), astype (adds and casts, half each), reshape (a chain of views: no kernels),
matmul (a [1, 256] × [256, 256] bf16 gemv), gemm (a decode step's attention product: [1, 64, 512] × [1, 512, 640]
bf16, which MLX hands to cuBLAS, captured from a stream into a child graph), custom (adds and one-thread `mx.fast.cuda_kernel` copies, half each). The line also records MLX's graph settings
from the environment, so one file can hold several processes' lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx

_SPIN = """
    long long start = clock64();
    long long cycles = (long long)budget[0];
    while (clock64() - start < cycles) { }
    out[0] = budget[0];
"""
_COPY = "out[0] = inp[0];"


def spin(cycles: float) -> mx.array:
    """One CUDA thread busy for `cycles` clock cycles (the device's queue held behind it); a scalar to evaluate."""
    kernel = mx.fast.cuda_kernel(name="probe_spin", input_names=["budget"], output_names=["out"], source=_SPIN)
    return kernel(inputs=[mx.array([cycles], dtype=mx.float32)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                  output_shapes=[(1,)], output_dtypes=[mx.float32])[0]


def spin_ms(cycles: float) -> float:
    """The spin's own milliseconds, evaluated alone: the median of 4 after a first (compiling) one."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        mx.eval(spin(cycles))
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times[1:])


def copy_kernel(x: mx.array) -> mx.array:
    kernel = mx.fast.cuda_kernel(name="probe_copy", input_names=["inp"], output_names=["out"], source=_COPY)
    return kernel(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[x.dtype])[0]


def nodes_of(kind: str, n: int, x: mx.array, w: mx.array) -> tuple[list[mx.array], int]:
    """~n graph nodes, mostly of `kind` (no fusion outside mx.compile) -> (the arrays, the node count)."""
    if kind == "add":
        return [x + float(i) for i in range(n)], n
    if kind == "astype":  # half adds, half casts
        return [(x + float(i)).astype(mx.float32) for i in range(n // 2)], 2 * (n // 2)
    if kind == "reshape":  # a chain of views on one kernel's output
        y = x + 1.0
        out = []
        for i in range(n):
            y = y.reshape(2, -1) if i % 2 == 0 else y.reshape(1, -1)
            out.append(y)
        return out, n + 1
    x256 = x[:, :256] + 0.0  # one kernel: the operands below are plain contiguous rows
    if kind == "matmul":
        return [x256 @ w for _ in range(n)], n + 2
    if kind == "gemm":  # 64 heads' queries against 640 shared rows; a scalar add keeps each product its own node
        q, rows_t = x[:, :512].reshape(1, 1, 512) + mx.zeros((1, 64, 1), x.dtype), w_rows_t(x.dtype)
        return [(q + float(i)) @ rows_t for i in range(n // 2)], 2 * (n // 2) + 3
    if kind == "custom":
        return [copy_kernel(x256 + float(i)) for i in range(n // 2)], 2 * (n // 2) + 2
    raise ValueError(kind)


def w_rows_t(dtype: mx.Dtype) -> mx.array:
    rows_t = mx.random.normal((1, 512, 640)).astype(dtype)
    mx.eval(rows_t)
    return rows_t


def measure(kind: str, n: int, x, w, cycles: float, spin_ms: float) -> dict:
    encode, device = [], []
    for _ in range(5):
        outs, count = nodes_of(kind, n, x, w)
        t0 = time.perf_counter()
        mx.async_eval(outs)
        encode.append((time.perf_counter() - t0) * 1e6 / count)
        mx.eval(outs)
        outs, count = nodes_of(kind, n, x, w)
        t1 = time.perf_counter()
        mx.async_eval(spin(cycles))
        mx.eval(outs)
        device.append(((time.perf_counter() - t1) * 1000 - spin_ms) * 1000 / count)
    return {"encode_us": statistics.median(encode[1:]), "device_us": statistics.median(device[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--nodes", type=int, default=600)
    p.add_argument("--spin-ms", type=float, default=30.0)
    args = p.parse_args()
    settings = {k: os.environ.get(k) for k in ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")}
    x = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    w = mx.random.normal((256, 256)).astype(mx.bfloat16)
    mx.eval(x, w)
    cycles = args.spin_ms * 1.98e6  # the H200's SM clock, ~1.98 GHz; spin_ms measures what it gives
    spin_alone = spin_ms(cycles)
    with open(args.out, "a") as out:
        for kind in ("add", "astype", "reshape", "matmul", "gemm", "custom"):
            row = {"kind": kind, "nodes": args.nodes, "settings": settings, "spin_ms": spin_alone,
                   **measure(kind, args.nodes, x, w, cycles, spin_alone)}
            out.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
