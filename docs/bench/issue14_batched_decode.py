"""Batched decode across sequences (docs/BENCHMARKS.md "Issue 14: batched decode across sequences"),
in one process: B sequences prefilled to CTX, then decode rounds of batch 1 and batch B in the order
1 B B 1, each with the decode rows batched per layer (engine/model/decode_attention.py, the default)
and through the per-sequence tile path (attention.BATCH_DECODE_ROWS = False), arms alternating;
then PAIRS paired steps (batched and per-sequence back to back, the first of the pair alternating:
load that drifts on a shared machine hits both arms alike; reported as the median of the per-pair
ratios), then the host time building a step's graph (batched arm, B 1 B B 1), then a stage-synced
split of both batches (the per-sequence arm syncs once per sequence and stage, so its split is inflated). One JSON line per measurement to OUT as soon as it exists;
progress on stdout.

H200 (checkpoint generated there, ~65 s; a quantized checkpoint is dequantized to bf16 here):
  python -m tessera.engine.tools.commands make-model /dev/shm/fw --preset flash-width --format official --no-tokenizer
  python docs/bench/issue14_batched_decode.py /dev/shm/fw /dev/shm/issue14-batched-h200.jsonl --ctx 16384 --batch 16 --cache-fill random
CPU (the same code path, small sizes):
  python docs/bench/issue14_batched_decode.py /tmp/ba-small out.jsonl --ctx 2048 --batch 8 --chunk 1024 --tile 256 --cache-fill random
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
from tessera.engine.model import attention  # noqa: E402
from tessera.engine.model.trace import ForwardTrace  # noqa: E402
from tessera.engine.tools.bench_decode import CACHE_FILLS, DecodeOptions, _decode_step, _filled  # noqa: E402

ARMS = {"batched": True, "per_sequence": False}


def main() -> None:
    args = _parser().parse_args()
    emit = jsonl_emitter(args.out, echo_chars=300)
    t0 = time.perf_counter()
    model = load_probe_model(args.model, args.as_loaded)
    emit("loaded", seconds=round(time.perf_counter() - t0, 2), dtype=str(model.dtype))
    options = DecodeOptions(chunk=args.chunk, tile=args.tile, cache_fill=args.cache_fill)
    caches = []
    for b in range(args.batch):
        caches.append(_filled(model, args.ctx, b, options))
        print(f"{args.cache_fill}: {b + 1}/{args.batch} caches at {args.ctx} ({time.perf_counter() - t0:.1f} s)", flush=True)
    for arm in ("batched", "per_sequence", "per_sequence", "batched"):
        for batch in (1, args.batch, args.batch, 1):
            steps = _decode_steps(model, caches[:batch], args.steps, ARMS[arm])
            median = statistics.median(steps)
            emit("decode", arm=arm, ctx=args.ctx, batch=batch, step_ms_median=median,
                 tokens_per_s=batch / median * 1000, step_ms=steps)
    for batch in (1, args.batch):
        emit("decode_paired", ctx=args.ctx, batch=batch, pairs=args.pairs, **_paired(model, caches[:batch], args.pairs))
    for batch in (1, args.batch, args.batch, 1):
        emit("decode_build_ms", arm="batched", ctx=args.ctx, batch=batch, **_build_ms(model, caches[:batch], args.steps))
    for arm in ("batched", "per_sequence"):
        for batch in (1, args.batch):
            emit("decode_stages_ms", arm=arm, ctx=args.ctx, batch=batch,
                 stage_ms=_stage_split(model, caches[:batch], ARMS[arm]))
    emit("done", seconds=round(time.perf_counter() - t0, 2))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out", help="JSON lines, one per measurement")
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--as-loaded", action="store_true",
                   help="keep a quantized checkpoint's weights as loaded (mxfp8/mxfp4), not dequantized to bf16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=12, help="measured steps per round (2 warm-up steps before)")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--pairs", type=int, default=16, help="paired steps per batch size")
    p.add_argument("--cache-fill", choices=CACHE_FILLS, default="prefill",
                   help="prefill: run random prompts; random: random rows of a prefill's shapes (no prefill time)")
    return p


def _decode_steps(model, caches, steps: int, batched: bool) -> list[float]:
    """Milliseconds of `steps` decode steps (after two warm-up steps) with the given decode path."""
    attention.BATCH_DECODE_ROWS = batched
    try:
        ids = [1] * len(caches)
        for _ in range(2):
            ids, _ = _decode_step(model, caches, ids, ForwardTrace(stage_sync=False))
        out = []
        for _ in range(steps):
            ids, seconds = _decode_step(model, caches, ids, ForwardTrace(stage_sync=False))
            out.append(seconds * 1000)
        return out
    finally:
        attention.BATCH_DECODE_ROWS = True


def _paired(model, caches, pairs: int) -> dict:
    """Step milliseconds of both arms, one step each per pair, the order alternating between pairs."""
    ids = [1] * len(caches)
    for batched in (True, False):  # warm both paths
        attention.BATCH_DECODE_ROWS = batched
        ids, _ = _decode_step(model, caches, ids, ForwardTrace(stage_sync=False))
    steps = {arm: [] for arm in ARMS}
    try:
        for p in range(pairs):
            for arm in (("batched", "per_sequence") if p % 2 == 0 else ("per_sequence", "batched")):
                attention.BATCH_DECODE_ROWS = ARMS[arm]
                ids, seconds = _decode_step(model, caches, ids, ForwardTrace(stage_sync=False))
                steps[arm].append(seconds * 1000)
    finally:
        attention.BATCH_DECODE_ROWS = True
    ratios = [p / b for b, p in zip(steps["batched"], steps["per_sequence"])]
    return {"batched_ms_median": statistics.median(steps["batched"]),
            "per_sequence_ms_median": statistics.median(steps["per_sequence"]),
            "per_sequence_over_batched_median": statistics.median(ratios),
            "batched_ms": steps["batched"], "per_sequence_ms": steps["per_sequence"]}


def _build_ms(model, caches, steps: int) -> dict:
    """Host milliseconds to build a decode step's graph (model.forward returning its lazy logits), and
    the rest of the step (evaluating it, the sampled ids to the host), batched arm: what per-sequence
    graph work costs shows in the first (docs/BENCHMARKS.md "Issue 14, session 6")."""
    from tessera.engine.model.deepseek_v4 import Segment

    ids, build, rest = [1] * len(caches), [], []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        logits = model.forward([Segment(c, [t]) for c, t in zip(caches, ids)], timer=ForwardTrace(stage_sync=False))
        t1 = time.perf_counter()
        ids = mx.argmax(mx.concatenate(logits), axis=-1).tolist()
        mx.eval([c.arrays() for c in caches])
        if step >= 2:
            build.append((t1 - t0) * 1000)
            rest.append((time.perf_counter() - t1) * 1000)
    return {"build_ms_median": statistics.median(build), "eval_ms_median": statistics.median(rest), "build_ms": build}


def _stage_split(model, caches, batched: bool, steps: int = 4) -> dict[str, float]:
    """Mean milliseconds per stage of a stage-synced step (every stage evaluated on its own)."""
    attention.BATCH_DECODE_ROWS = batched
    try:
        ids, totals = [1] * len(caches), {}
        for _ in range(steps):
            timer = ForwardTrace(stage_sync=True)
            ids, _ = _decode_step(model, caches, ids, timer)
            for name, seconds in timer.as_dict().items():
                totals[name] = totals.get(name, 0.0) + seconds * 1000 / steps
        return totals
    finally:
        attention.BATCH_DECODE_ROWS = True


if __name__ == "__main__":
    main()
