"""A one-row append into a large buffer (`buffer[n:n+1] = row`, as engine/model/cache.py's RowBuffer appends) with
and without an earlier computation that reads the buffer still in flight (docs/BENCHMARKS.md "Session 17").

python docs/bench/append_donation_probe.py OUT.jsonl [--mib 512] [--rounds 3]

MLX writes the row in place only when nothing else holds the buffer; otherwise it copies the whole buffer
first. Per round: the reader alone (`reader_ms`: a slice of the buffer summed, plus a 2048² matmul to keep it
busy), the reader queued (`mx.async_eval`) and then the append (`reader_and_append_ms`, both waited for), and
the append alone once nothing holds the buffer (`append_alone_ms`). One JSON line per round.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from docs.bench.probe_io import jsonl_emitter  # noqa: E402

WIDTH = 512


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--mib", type=int, default=512, help="the buffer's size (float32 rows of 512)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    emit = jsonl_emitter(args.out)
    rows = args.mib * 2**20 // (WIDTH * 4)
    buffer = mx.zeros((rows, WIDTH), dtype=mx.float32)
    row, busy = mx.ones((1, WIDTH)), mx.random.normal((2048, 2048))
    mx.eval(buffer, row, busy)

    def reader(x: mx.array) -> mx.array:
        return x[:4].sum() + (busy @ busy).sum()

    for r in range(args.rounds):
        t0 = time.perf_counter()
        mx.eval(reader(buffer))
        reader_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        queued = reader(buffer)
        mx.async_eval(queued)
        buffer[100 + r : 101 + r] = row
        mx.eval(buffer, queued)
        both_ms = (time.perf_counter() - t0) * 1e3
        queued = None
        t0 = time.perf_counter()
        buffer[200 + r : 201 + r] = row
        mx.eval(buffer)
        emit("append", mib=args.mib, reader_ms=reader_ms, reader_and_append_ms=both_ms,
             append_alone_ms=(time.perf_counter() - t0) * 1e3)


if __name__ == "__main__":
    main()
