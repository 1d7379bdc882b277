"""GPU against CPU on the same inputs, op by op and layer by layer (session 8 left this open: a `tiny`
float32 model's 1-token prompt gave logits on the H200 that differ from the CPU's far beyond TF32-level
noise; docs/BENCHMARKS.md, "Session 8 on the H200").

  python docs/bench/gpu_vs_cpu_probe.py OUT.jsonl [--lengths 1,5,62] [--dtype float32|bfloat16] [--no-compile]

Part 1, ops: the MLX ops the model's GPU path runs differently from the CPU's (float32 matmul: TF32
on CUDA; the expert-sorted `gather_mm` of M = 1 rows that runs CUTLASS's grouped GEMM on CUDA; the
Sinkhorn and row-gather kernels), each at the `tiny` model's shapes, as max |GPU − CPU| / max |CPU|.
Part 2, layers: each layer run on both devices from the same input streams (the CPU's output of the
layer before), so a wrong layer shows alone instead of through every later one; then the logits.
Where TF32 is the only difference, every row stays near 1e-3; a wrong op or layer stands out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tessera.kernels import shapeless


def rel_diff(gpu: mx.array, cpu: mx.array) -> float:
    g, c = np.array(gpu.astype(mx.float32)), np.array(cpu.astype(mx.float32))
    return float(np.abs(g - c).max() / max(np.abs(c).max(), 1e-30))


def on_both(fn):
    """fn() evaluated on the GPU and on the CPU -> (gpu, cpu)."""
    outs = []
    for device in (mx.gpu, mx.cpu):
        with mx.stream(device):
            out = fn()
            mx.eval(out)
            outs.append(out)
    return outs


def op_rows(dtype) -> list[dict]:
    rng = np.random.default_rng(0)
    arr = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)  # noqa: E731
    x, w = arr(10, 64), arr(64, 32)
    experts = mx.array(np.sort(rng.integers(0, 4, 10)).astype(np.uint32))
    xs, ws = arr(10, 1, 64), arr(4, 64, 32)
    rows = []
    for name, fn in [
        ("matmul [10,64]@[64,32]", lambda: x @ w),
        ("gather_mm sorted M=1 [10,1,64]x[4,64,32]", lambda: mx.gather_mm(xs, ws, rhs_indices=experts, sorted_indices=True)),
        ("gather_mm unsorted M=1", lambda: mx.gather_mm(xs, ws, rhs_indices=experts[::-1])),
        ("per-row loop reference", lambda: mx.concatenate([xs[i] @ ws[int(e)] for i, e in enumerate(np.array(experts))])[:, None]),
    ]:
        gpu, cpu = on_both(fn)
        rows.append({"what": "op", "op": name, "dtype": str(dtype), "rel_diff": rel_diff(gpu, cpu)})
    return rows


def layer_rows(model, lengths: list[int]) -> list[dict]:
    rows = []
    for seed, n in enumerate(lengths):
        tokens = random_tokens(model.cfg.vocab_size, n, seed)
        segs = {mx.gpu: [Segment(model.new_cache(), tokens)], mx.cpu: [Segment(model.new_cache(), tokens)]}
        with mx.stream(mx.cpu):
            streams = model.embed(segs[mx.cpu])
            mx.eval(streams)
        for i in model.layer_ids:
            out = {}
            for device in (mx.gpu, mx.cpu):
                with mx.stream(device):
                    out[device] = model.run_layers(streams, segs[device], range(i, i + 1), tile=16)
                    mx.eval(out[device])
            rows.append({"what": "layer", "prompt": n, "layer": i, "kind": model.cfg.layer_types[i],
                         "rel_diff": rel_diff(out[mx.gpu], out[mx.cpu])})
            streams = out[mx.cpu]
        logits = {}
        for device in (mx.gpu, mx.cpu):
            with mx.stream(device):
                logits[device] = model.logits(streams[-1:], segs[device], False)[0]
                mx.eval(logits[device])
        rows.append({"what": "logits", "prompt": n, "rel_diff": rel_diff(logits[mx.gpu], logits[mx.cpu])})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--lengths", default="1,5,62")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/gpu-vs-cpu-tiny"))
    p.add_argument("--no-compile", action="store_true",
                   help="run the shapeless-compiled functions plain (fused GPU kernels out of the picture; run both ways)")
    args = p.parse_args()
    if args.no_compile:
        shapeless.set_compile_enabled(False)
    dtype = getattr(mx, args.dtype)
    path = make_model(args.model_dir, "tiny", seed=8, with_tokenizer=False, layer_types=[WINDOW, CSA, HCA, CSA],
                      num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
    model = load_model(path, dtype=args.dtype)
    rows = op_rows(dtype) + layer_rows(model, [int(n) for n in args.lengths.split(",")])
    with args.out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
