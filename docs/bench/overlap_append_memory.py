"""Does a compressed-row append copy its sequence's whole buffer when the step before is still running?
(docs/BENCHMARKS.md "Session 17 (CPU only)": MLX keeps every input of an encoded kernel alive until the
device has run it, and an in-place `buffer[n:n+1] = row` is in place only when nothing else holds the buffer.)

python docs/bench/overlap_append_memory.py MODEL OUT.jsonl [--ctx 262144] [--steps 8] [--rounds 2] [--as-loaded]

One sequence at CTX (random cache rows), then rounds of two arms in the order serial overlapped overlapped
serial (--rounds times), `--steps` decode steps each:
- serial: each step built, queued and waited for before the next is built;
- overlapped: step n + 1 built and queued while step n runs (what the serving overlap does), then step n
  waited for.
Per round: the peak memory above the round's start (`peak_mib`) and each step's time (from the
previous step's logits ready to its own). A step that closes a
CSA window appends a row to the layer's compressed rows and index keys; if the append copies the buffers,
the overlapped rounds' peak exceeds the serial ones' by about the largest of them (`buffer_mib`: each CSA
layer's compressed rows and index keys, capacity). One JSON line per round, then a summary.
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

from docs.bench.probe_io import jsonl_emitter, load_probe_model  # noqa: E402
from tessera.engine.model.deepseek_v4 import Segment  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled  # noqa: E402

ARMS = ("serial", "overlapped")


def run_round(model, cache, overlapped: bool, steps: int) -> tuple[float, list[float]]:
    """-> (peak MiB above the active memory at the start, ms between one step's logits being ready and the
    next's)."""
    mx.synchronize()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    ready, queued = [time.perf_counter()], None  # queued: the logits of the step not yet waited for
    for _ in range(steps):
        logits = model.forward([Segment(cache, [1])])
        mx.async_eval(logits, cache.arrays())
        if queued is not None or not overlapped:
            mx.eval(queued if overlapped else logits)
            ready.append(time.perf_counter())
        queued = logits
    if overlapped:
        mx.eval(queued)
        ready.append(time.perf_counter())
    mx.synchronize()
    return (mx.get_peak_memory() - start) / 2**20, [(b - a) * 1e3 for a, b in zip(ready, ready[1:])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--ctx", type=int, default=262144)
    p.add_argument("--steps", type=int, default=8, help="decode steps a round (two CSA windows close in 8)")
    p.add_argument("--rounds", type=int, default=2, help="serial overlapped overlapped serial sequences")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--as-loaded", action="store_true", help="keep a quantized checkpoint's weights as loaded")
    args = p.parse_args()
    emit = jsonl_emitter(args.out)
    model = load_probe_model(args.model, args.as_loaded)
    cache = _filled(model, args.ctx, 0, DecodeOptions(chunk=args.chunk, tile=1024, cache_fill="random"))
    buffers = [layer.compressed.capacity_nbytes + (layer.index_keys.capacity_nbytes if layer.index_keys else 0)
               for layer in cache.layers if layer.compressed is not None and layer.index_keys is not None]
    emit("filled", ctx=args.ctx, buffer_mib=[round(b / 2**20, 1) for b in buffers])
    run_round(model, cache, True, 2)  # warm: first-use compilation
    peaks: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for arm in (ARMS + ARMS[::-1]) * args.rounds:
        peak, times = run_round(model, cache, arm == "overlapped", args.steps)
        peaks[arm].append(peak)
        emit("round", arm=arm, ctx=args.ctx, peak_mib=round(peak, 2), step_ms=[round(t, 3) for t in times],
             step_ms_median=statistics.median(times))
    emit("summary", ctx=args.ctx, **{f"{arm}_peak_mib": max(v) for arm, v in peaks.items()},
         largest_buffer_mib=round(max(buffers, default=0) / 2**20, 1))


if __name__ == "__main__":
    main()
