"""Can Python build MLX graphs while a second thread encodes another? What serializes them, if not.

python docs/bench/mlx_thread_overlap.py OUT.jsonl [--nodes 400] [--reps 20]

No model. The decode step's encode thread (engine/model/encode_thread.py) is meant to overlap the step's two
host halves — Python building a layer's graph and MLX encoding the previous one — but on the H200 (session 12)
building took as long with the thread as building and encoding together. This probe separates the suspects
with graphs that resemble a decode layer's (chains of small elementwise ops on one [1, 4096] row):

- encode: `mx.async_eval` of a prebuilt graph of `--nodes` kernels, in a second thread (it releases the GIL);
- builders, each timed alone and then while the thread encodes (the thread starts first, and each build
  runs inside its encode):
  - python: a pure-Python loop (no MLX call): slows down only if the GIL is not free while MLX encodes;
  - views: reshapes (graph nodes, no kernel, no allocation);
  - ops: elementwise adds of two arrays (graph nodes that will be kernels);
  - scalars: adds of a Python float (each makes a one-element array: an allocation when built);
  - compiled: calls of a small `mx.compile`d function (a replay of its trace per call, as the step's compiled parts);
  - ops_other_stream: `ops` built on a stream of its own (`mx.new_stream`) instead of the encoder's.

One JSON line per builder: median wall ms alone and during the encode, the encode's own ms alone and during
the build, and `overlap` = (build alone + encode alone) / wall of both together (1: serial, up to 2:
perfectly overlapped when the two halves are equal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import mlx.core as mx

WIDTH = 4096


def chain(x: mx.array, y: mx.array, nodes: int) -> mx.array:
    """`nodes` dependent elementwise kernels (no fusion outside mx.compile)."""
    for _ in range(nodes):
        x = x + y
    return x


def build_python(_x, _y, nodes: int):
    total = 0
    for i in range(nodes * 40):  # ~ as long as building `nodes` MLX ops
        total += i * i
    return total


def build_views(x, _y, nodes: int):
    for _ in range(nodes):
        x = x.reshape(WIDTH, 1).reshape(1, WIDTH)
    return x


def build_ops(x, y, nodes: int):
    return chain(x, y, nodes)


def build_scalars(x, _y, nodes: int):
    for _ in range(nodes):
        x = x + 1.0
    return x


def _layer_like(x, y):
    """A small fixed-shape function, compiled: a replay per call, as a decode step's compiled parts."""
    for _ in range(8):
        x = (x @ mx.ones((WIDTH, 1), dtype=x.dtype)).reshape(1, 1) * x + y
    return x


_compiled_layer_like = mx.compile(_layer_like)


def build_compiled(x, y, nodes: int):
    for _ in range(nodes // 16):
        x = _compiled_layer_like(x, y)
    return x


BUILDERS = {"python": build_python, "views": build_views, "ops": build_ops, "scalars": build_scalars,
            "compiled": build_compiled}


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return 1e3 * (time.perf_counter() - t0), out


def run_pair(build, encode_stream, build_stream, nodes: int) -> dict:
    """One build alone, one encode alone, then the two at once (the encode in a thread)."""
    with mx.stream(encode_stream):
        a = mx.random.normal((1, WIDTH)).astype(mx.bfloat16)
        b = mx.random.normal((1, WIDTH)).astype(mx.bfloat16)
        mx.eval(a, b)
    with mx.stream(build_stream):
        build_alone, out = timed(lambda: build(a, b, nodes))
    del out
    with mx.stream(encode_stream):
        graph = chain(a, b, nodes)
    encode_alone, _ = timed(lambda: mx.async_eval(graph))
    mx.synchronize()

    with mx.stream(encode_stream):
        graph = chain(a, b, nodes)
    started = threading.Event()
    encode_during = []

    def encode():
        started.set()
        ms, _ = timed(lambda: mx.async_eval(graph))
        encode_during.append(ms)

    t0 = time.perf_counter()
    thread = threading.Thread(target=encode)
    thread.start()
    started.wait()
    with mx.stream(build_stream):
        build_during, out = timed(lambda: build(a, b, nodes))
    thread.join()
    both = 1e3 * (time.perf_counter() - t0)
    del out
    mx.synchronize()
    return {"build_alone": build_alone, "encode_alone": encode_alone, "build_during": build_during,
            "encode_during": encode_during[0], "both": both}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--nodes", type=int, default=400)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    sys.setswitchinterval(50e-6)  # as engine/model/encode_thread.py sets it
    device = mx.default_device()
    encode_stream = mx.new_thread_unsafe_stream(device)  # the encode thread's kind of stream
    other = mx.new_stream(device)
    cases = [(name, fn, encode_stream) for name, fn in BUILDERS.items()] + [("ops_other_stream", build_ops, other)]
    with open(args.out, "a") as f:
        for name, fn, build_stream in cases:
            for _ in range(3):  # warm-up: kernels compiled, buffers cached
                run_pair(fn, encode_stream, build_stream, args.nodes)
            runs = [run_pair(fn, encode_stream, build_stream, args.nodes) for _ in range(args.reps)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            line = {"builder": name, "nodes": args.nodes, "reps": args.reps, "device": str(device),
                    **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                    "overlap": round((med["build_alone"] + med["encode_alone"]) / med["both"], 3)}
            print(json.dumps(line), flush=True)
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
