"""A decode batch's projections through MLX's quantized matmul: mxfp8 weights at V4 Flash's attention and shared
expert shapes, 1, 8 and 16 rows (a decode batch of that many sequences), against the same weights
dequantized to bf16 (`x @ w.T`, cuBLAS) and mxfp8 in pieces of at most 7 rows (MLX's CUDA QuantizedMatmul
runs its gemv, qmv, below 8 rows and a CuTe GEMM, qmm_sm80, from 8 on). ms per call (an eval each, median
of 20), one process, A B C C B A per shape and row count. One JSON line per measurement to OUT.

  python docs/bench/projection_rows_probe.py OUT.jsonl [--small]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.probe_io import jsonl_emitter  # noqa: E402

# (name, out, in): the stacked q_a + kv rows, q_b, o_a, o_b, the shared expert's w1 (w3 alike) and w2
SHAPES = [("q_a+kv", 1536, 4096), ("q_b", 32768, 1024), ("o_a", 8192, 4096), ("o_b", 4096, 8192),
          ("shared_w1", 2048, 4096), ("shared_w2", 4096, 2048)]
SMALL = [("small", 256, 1024)]


def _settings(values: mx.array, scales: mx.array, dense: mx.array):
    def mxfp8(x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, values, scales, None, transpose=True, group_size=32, bits=8, mode="mxfp8")

    def pieces(x: mx.array) -> mx.array:
        return mx.concatenate([mxfp8(x[s : s + 7]) for s in range(0, x.shape[0], 7)])

    return {"mxfp8": mxfp8, "bf16": lambda x: x @ dense.T, "mxfp8_pieces_7": pieces}


def _ms(fn, x: mx.array, repeat: int = 20) -> float:
    times = []
    for _ in range(repeat + 3):
        start = time.perf_counter()
        mx.eval(fn(x))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--small", action="store_true", help="one small shape (a CPU smoke run)")
    args = p.parse_args()
    emit = jsonl_emitter(args.out)
    for name, out_dim, in_dim in SMALL if args.small else SHAPES:
        w = mx.random.normal((out_dim, in_dim), dtype=mx.bfloat16) * 0.02
        values, scales = mx.quantize(w, group_size=32, bits=8, mode="mxfp8")
        dense = mx.dequantize(values, scales, None, group_size=32, bits=8, mode="mxfp8", dtype=mx.bfloat16)
        mx.eval(values, scales, dense)
        settings = _settings(values, scales, dense)
        for rows in (1, 8, 16):
            x = mx.random.normal((rows, in_dim), dtype=mx.bfloat16)
            mx.eval(x)
            for setting in list(settings) + list(settings)[::-1]:
                emit("op", shape=name, out=out_dim, rows=rows, setting=setting, ms=_ms(settings[setting], x))


if __name__ == "__main__":
    main()
