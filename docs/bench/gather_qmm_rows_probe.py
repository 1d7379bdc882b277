"""Quantized experts at decode batch sizes: one gather_qmm call for all gathered rows against pieces of
fewer than 8 rows (MLX's CUDA qmv kernel; engine/model/moe.py GATHER_QMV_ROWS), in one process, A B B A.

1. The op alone at V4 Flash's expert shapes (256 experts, mxfp4, 4096 -> 2048 and 2048 -> 4096, bf16 rows):
   6, 16, 48, 96 pairs (a decode step of 1, ~3, 8, 16 sequences), ms per call.
2. With a checkpoint: decode steps of batch 1 and batch B through `model.forward` (weights as loaded),
   GATHER_QMV_ROWS None against 7, A B B A.
One JSON line per measurement to OUT.

  python docs/bench/gather_qmm_rows_probe.py OUT.jsonl [--model /dev/shm/fw --ctx 16384 --batch 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere inside the repo

from tessera.engine.model import moe  # noqa: E402
from tessera.engine.model.quantized import QuantizedWeight  # noqa: E402

EXPERTS, HIDDEN, INTER = 256, 4096, 2048  # overridden by --small (a CPU smoke run)
SETTINGS = {"one_call": None, "qmv_pieces_7": 7}


def _quantized(out_dim: int, in_dim: int) -> QuantizedWeight:
    w = mx.random.normal((EXPERTS, out_dim, in_dim), dtype=mx.bfloat16) * 0.02
    values, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    mx.eval(values, scales)
    return QuantizedWeight(values, scales, None, "mxfp4", 4, 32)


def _op_ms(x: mx.array, w: QuantizedWeight, experts: mx.array, repeat: int = 20) -> float:
    times = []
    for _ in range(repeat + 3):
        start = time.perf_counter()
        mx.eval(moe._gather_linear(x, w, experts))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[3:])


def op_rounds(emit) -> None:
    up, down = _quantized(INTER, HIDDEN), _quantized(HIDDEN, INTER)
    for pairs in (6, 16, 48, 96):
        experts = mx.sort(mx.random.randint(0, EXPERTS, (pairs,)).astype(mx.uint32))
        x_up = mx.random.normal((pairs, 1, HIDDEN), dtype=mx.bfloat16)
        x_down = mx.random.normal((pairs, 1, INTER), dtype=mx.bfloat16)
        mx.eval(experts, x_up, x_down)
        for name in ("one_call", "qmv_pieces_7", "qmv_pieces_7", "one_call"):
            moe.GATHER_QMV_ROWS = SETTINGS[name]
            emit("op", setting=name, pairs=pairs, up_ms=_op_ms(x_up, up, experts), down_ms=_op_ms(x_down, down, experts))
    moe.GATHER_QMV_ROWS = None


def decode_rounds(emit, model_dir: str, ctx: int, batch: int, steps: int) -> None:
    from tessera.engine.model.loader import load_model
    from tessera.engine.model.trace import ForwardTrace
    from tessera.engine.tools.bench_decode import DecodeOptions, _decode_step, _filled

    model = load_model(Path(model_dir))
    caches = [_filled(model, ctx, b, DecodeOptions(cache_fill="random")) for b in range(batch)]
    for size in (1, batch):
        for name in ("one_call", "qmv_pieces_7", "qmv_pieces_7", "one_call") * 2:
            moe.GATHER_QMV_ROWS = SETTINGS[name]
            ids, times = [1] * size, []
            for step in range(steps + 2):
                ids, seconds = _decode_step(model, caches[:size], ids, ForwardTrace(stage_sync=False))
                if step >= 2:
                    times.append(seconds * 1000)
            median = statistics.median(times)
            emit("decode", setting=name, ctx=ctx, batch=size, step_ms_median=median, tokens_per_s=size / median * 1000)
    moe.GATHER_QMV_ROWS = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default=None)
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--small", action="store_true", help="8 experts of 256 -> 128 (a CPU smoke run)")
    args = p.parse_args()
    if args.small:
        global EXPERTS, HIDDEN, INTER
        EXPERTS, HIDDEN, INTER = 8, 256, 128
    out = open(args.out, "w")

    def emit(kind: str, **row) -> None:
        line = json.dumps({"what": kind, "device": str(mx.default_device()), **row})
        out.write(line + "\n")
        out.flush()
        print(line, flush=True)

    op_rounds(emit)
    if args.model:
        decode_rounds(emit, args.model, args.ctx, args.batch, args.steps)


if __name__ == "__main__":
    main()
