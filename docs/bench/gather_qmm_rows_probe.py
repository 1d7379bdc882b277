"""Quantized experts at decode batch sizes: one gather_qmm call for all gathered rows (one row per pair)
against pieces of 7 rows — MLX's CUDA GatherQMM runs its gemv kernel (qmv) only below 8 rows, a tensor-core
GEMM tile per row above — and, on CUDA, kernels/gather_qmv.py's kernel, in one process, A B C C B A. The op alone at V4 Flash's expert shapes (256 experts,
mxfp4, 4096 -> 2048 and 2048 -> 4096, bf16 rows): 6, 16, 48, 96 pairs (a decode step of 1, ~3, 8, 16
sequences), ms per call. One JSON line per measurement to OUT. (Session 10's run also timed decode steps
with the pieces inside engine/model/moe.py, a switch since removed: commit 0bef5c8.)

  python docs/bench/gather_qmm_rows_probe.py OUT.jsonl [--small]
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
from tessera.kernels.cuda import on_cuda  # noqa: E402
from tessera.engine.model.quantized import QuantizedWeight  # noqa: E402

EXPERTS, HIDDEN, INTER = 256, 4096, 2048  # overridden by --small (a CPU smoke run)
SETTINGS = {"one_call": None, "qmv_pieces_7": 7}  # rows per gather_qmm call (None: all)
KERNELS = {"gather_qmv_x_staged": True, "gather_qmv_x_direct": False}  # kernels/gather_qmv.py (CUDA only)


def _quantized(out_dim: int, in_dim: int) -> QuantizedWeight:
    w = mx.random.normal((EXPERTS, out_dim, in_dim), dtype=mx.bfloat16) * 0.02
    values, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    mx.eval(values, scales)
    return QuantizedWeight(values, scales, None, "mxfp4", 4, 32)


def _gather_qmm(x: mx.array, w: QuantizedWeight, experts: mx.array, piece: int | None) -> mx.array:
    """x [P, 1, in] -> [P, 1, out], pair p through expert experts[p], `piece` pairs a call."""
    piece = piece or x.shape[0]
    return mx.concatenate([
        mx.gather_qmm(x[s : s + piece], w.values, w.scales, None, rhs_indices=experts[s : s + piece], transpose=True,
                      group_size=w.group_size, bits=w.bits, mode=w.mode)
        for s in range(0, x.shape[0], piece)])


def _op_ms(x: mx.array, w: QuantizedWeight, experts: mx.array, setting: str, repeat: int = 20) -> float:
    from tessera.kernels.gather_qmv import gather_qmv_kernel

    def run() -> mx.array:
        if setting in KERNELS:
            return gather_qmv_kernel(x[:, 0, :], w.values, w.scales, experts, stage_x=KERNELS[setting])
        return _gather_qmm(x, w, experts, SETTINGS[setting])

    times = []
    for _ in range(repeat + 3):
        start = time.perf_counter()
        mx.eval(run())
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[3:])


def op_rounds(emit) -> None:
    up, down = _quantized(INTER, HIDDEN), _quantized(HIDDEN, INTER)
    for pairs in (6, 16, 48, 96):
        experts = mx.sort(mx.random.randint(0, EXPERTS, (pairs,)).astype(mx.uint32))
        x_up = mx.random.normal((pairs, 1, HIDDEN), dtype=mx.bfloat16)
        x_down = mx.random.normal((pairs, 1, INTER), dtype=mx.bfloat16)
        mx.eval(experts, x_up, x_down)
        order = ["one_call", "qmv_pieces_7"] + (list(KERNELS) if on_cuda() else [])
        for name in order + order[::-1]:
            emit("op", setting=name, pairs=pairs, up_ms=_op_ms(x_up, up, experts, name),
                 down_ms=_op_ms(x_down, down, experts, name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--small", action="store_true", help="8 experts of 256 -> 128 (a CPU smoke run)")
    args = p.parse_args()
    if args.small:
        global EXPERTS, HIDDEN, INTER
        EXPERTS, HIDDEN, INTER = 8, 256, 128
    op_rounds(jsonl_emitter(args.out))


if __name__ == "__main__":
    main()
