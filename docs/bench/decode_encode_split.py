"""Where a decode step's host time goes, by stage: MLX's encoding of each stage's kernels, at several batch sizes.

python docs/bench/decode_encode_split.py MODEL OUT.jsonl [--ctx 16384] [--batch 16 1] [--steps 24] [--rounds 2]
    [--compile-step on|off] [--as-loaded]

A batch-16 step costs the host about twice a batch-1 step although its graph has only ~10 % more nodes
(docs/BENCHMARKS.md, "Session 13"). This probe says which stage's encoding grows: the step is built as
usual (no stage syncs, the step compile as set), but at each stage mark the graph built since the last one
is handed to the device with `mx.async_eval` and that call is timed — the host's cost of encoding that
stage, which does not wait for the device (the device runs what was encoded while the host goes on).
Stages, in a layer's order: `other` (the attention input: hyper-connection collapse, norm), `indexer_score`,
`topk`, `attention` (the rest of attention: projections, compressors, cache writes, the attention itself),
`moe` (the FFN half: expand, collapse, norm, MoE, expand); `head` is the last layer's output to the sampled
ids. `build_ms` is Python's time building the graph (the step's wall time less every encode).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.probe_io import jsonl_emitter, load_probe_model  # noqa: E402
from tessera.engine.model.compiled import set_step_compile_enabled  # noqa: E402
from tessera.engine.model.deepseek_v4 import Segment  # noqa: E402
from tessera.engine.model.trace import ForwardTrace  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled  # noqa: E402


class EncodeTimer(ForwardTrace):
    """A trace without stage syncs whose stage marks encode what was built since the last one, timed."""

    def __init__(self) -> None:
        super().__init__(stage_sync=False)
        self.encode_ms: dict[str, float] = defaultdict(float)

    def stage(self, name: str, *arrays: mx.array) -> mx.array:
        t0 = time.perf_counter()
        mx.async_eval(*arrays)
        self.encode_ms[name] += (time.perf_counter() - t0) * 1000
        return arrays[0]


def step(model, caches, ids: list[int]) -> tuple[list[int], dict[str, float]]:
    timer = EncodeTimer()
    t0 = time.perf_counter()
    logits = model.forward([Segment(c, [t]) for c, t in zip(caches, ids)], timer=timer)
    sampled = mx.argmax(mx.concatenate(logits), axis=-1)
    t1 = time.perf_counter()
    mx.async_eval(sampled, *[a for c in caches for a in c.arrays()])
    timer.encode_ms["head"] += (time.perf_counter() - t1) * 1000
    t2 = time.perf_counter()
    ids = sampled.tolist()
    row = dict(timer.encode_ms)
    row["build_ms"] = (t1 - t0) * 1000 - sum(v for k, v in row.items() if k != "head")
    row["wait_ms"] = (time.perf_counter() - t2) * 1000
    row["step_ms"] = (time.perf_counter() - t0) * 1000
    return ids, row


def rounds(model, caches, steps: int) -> list[dict[str, float]]:
    ids, rows = [1] * len(caches), []
    for _ in range(steps):
        ids, row = step(model, caches, ids)
        rows.append(row)
    return rows


def main() -> None:
    args = _parser().parse_args()
    emit = jsonl_emitter(args.out)
    set_step_compile_enabled(args.compile_step == "on")
    model = load_probe_model(args.model, args.as_loaded)
    caches = [_filled(model, args.ctx, b, DecodeOptions(chunk=4096, tile=1024, cache_fill="random"))
              for b in range(max(args.batch))]
    for batch in args.batch:
        t0 = time.perf_counter()
        rounds(model, caches[:batch], 3)
        emit("warm", batch=batch, seconds=time.perf_counter() - t0)
    for _ in range(args.rounds):
        for batch in args.batch + args.batch[::-1]:
            rows = rounds(model, caches[:batch], args.steps)
            keys = sorted({k for r in rows for k in r})
            emit("round", ctx=args.ctx, batch=batch, compile_step=args.compile_step,
                 median_ms={k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}, steps=rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 1])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compile-step", choices=("on", "off"), default="on")
    p.add_argument("--as-loaded", action="store_true")
    return p


if __name__ == "__main__":
    main()
