"""GPU against CPU on the same inputs, op by op (session 8 left this open: a `tiny` float32 model's
1-token prompt gave logits on the H200 that differ from the CPU's far beyond TF32-level noise;
docs/BENCHMARKS.md, "Session 8 on the H200"). `tessera check gpu` compares the layers and logits
(engine/tools/device_agreement.py); this narrows a disagreeing layer down to the MLX ops its GPU path
runs differently from the CPU's: the float32 matmul (TF32 on CUDA) and the expert-sorted `gather_mm` of
M = 1 rows (CUTLASS's grouped GEMM on CUDA: the gathered MoE of short prompts and decode), at the `tiny`
model's shapes, as max |GPU − CPU| / max |CPU|. TF32 alone stays near 1e-3.

  python docs/bench/gpu_vs_cpu_probe.py OUT.jsonl [--dtype float32|bfloat16]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from tessera.engine.tools.device_agreement import rel_diff


def on_both(fn):
    """fn() evaluated on the GPU and on the CPU -> (gpu, cpu)."""
    outs = []
    for device in (mx.gpu, mx.cpu):
        with mx.stream(device):
            outs.append(fn())
            mx.eval(outs[-1])
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
        ("one matmul per row [1,64]@[64,32] (what gather_mm computes)", lambda: mx.concatenate([xs[i] @ ws[int(e)] for i, e in enumerate(np.array(experts))])[:, None]),
    ]:
        gpu, cpu = on_both(fn)
        rows.append({"what": "op", "op": name, "dtype": str(dtype), "rel_diff": rel_diff(gpu, cpu)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    rows = op_rows(getattr(mx, args.dtype))
    with args.out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
