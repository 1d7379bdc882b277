"""Issue 14, session 7: a decode step with its shape-stable parts compiled with fixed shapes
(engine/model/compiled.py, StepCompiled, TESSERA_COMPILE_STEP) against the plain step, in one process.
docs/BENCHMARKS.md, "Issue 14, session 7: the decode step compiled".

python docs/bench/issue14_step_compile.py MODEL_DIR OUT.jsonl [--ctx 65536] [--batch 1 16] [--steps 30] [--cache-fill random]

H200 (the model as loaded: mxfp8 projections, mxfp4 experts):
  python docs/bench/issue14_step_compile.py /dev/shm/fw docs/bench/h200-session7-step-compile.jsonl --batch 1 16
CPU (the same code path at small sizes):
  python docs/bench/issue14_step_compile.py /tmp/small OUT.jsonl --ctx 2048 --chunk 1024 --tile 256 --batch 1 8 --steps 20

Per batch size B: B caches filled to --ctx (`random`: random rows of a prefill's shapes, the default; or a
chunked, tiled prefill); then two plain steps and the first compiled step (`first_step`: `trace_ms` = the
compiled one's excess over the second plain one: the traces, one per layer part and batch size, and on a
GPU the fused kernels' JIT compilation) and the graph's primitives with the switch off and on (`primitives`,
`mx.export_to_dot` of the logits and caches); then rounds of --steps timed greedy steps (2 untimed warm-up
steps each) with the switch in the order off on on off on off off on. Per step: `build_ms` = until
`model.forward` returns (Python building the graph; with the switch on, the compiled parts replay from
C++), `build_cpu_ms` = the same span in this thread's CPU time (less disturbed by other processes), `eval_ms` = from there until the greedy ids are on the host, `total_ms`. `summary` per B: medians
over all steps of an arm and `total_ms_on_over_off` (< 1: the compiled step is faster). One JSON line per
measurement to OUT.jsonl (stdout shortened). Budget: after loading, no round starts once --budget-s (120)
is spent.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

import mlx.core as mx  # noqa: E402

from tessera.engine.model.compiled import set_step_compile_enabled, step_compile_enabled  # noqa: E402
from tessera.kernels.shapeless import compile_enabled  # noqa: E402
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment  # noqa: E402
from tessera.engine.model.loader import load_model  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled  # noqa: E402

ORDER = (False, True, True, False, True, False, False, True)  # the switch per round
WARMUP = 2


def main() -> None:
    args = _parser().parse_args()
    out = open(args.out, "w")
    clock = time.perf_counter()

    def emit(what: str, **row) -> None:
        line = json.dumps({"what": what, "seconds": round(time.perf_counter() - clock, 2), **row})
        out.write(line + "\n")
        out.flush()
        print(line[:240], flush=True)

    at_start = step_compile_enabled()
    emit("start", device=str(mx.default_device()), mlx=mx.__version__, ctx=args.ctx, batches=args.batch,
         steps=args.steps, cache_fill=args.cache_fill, compile=compile_enabled(), step_compile_at_start=at_start)
    model = load_model(Path(args.model))
    emit("loaded", load_seconds=round(time.perf_counter() - clock, 2))
    deadline = time.perf_counter() + args.budget_s
    for batch in args.batch:
        caches = [_filled(model, args.ctx, b, DecodeOptions(args.chunk, args.tile, cache_fill=args.cache_fill)) for b in range(batch)]
        mx.eval([c.arrays() for c in caches])
        ids = [1] * batch
        first = {}
        for enabled in (False, False, True):  # plain twice (its own first-use costs), then the traces
            set_step_compile_enabled(enabled)
            ids, row = _step(model, caches, ids)
            first[enabled] = row["total_ms"]
        emit("first_step", batch=batch, plain_ms=round(first[False], 3), compiled_ms=round(first[True], 3),
             trace_ms=round(first[True] - first[False], 3))
        for enabled in (False, True):
            set_step_compile_enabled(enabled)
            emit("primitives", batch=batch, step_compile=enabled, **_primitives(model, caches, ids))
        results: dict[bool, list[dict]] = collections.defaultdict(list)
        for round_index, enabled in enumerate(ORDER):
            if time.perf_counter() > deadline:
                emit("skipped", batch=batch, round=round_index, reason=f"--budget-s {args.budget_s} spent")
                continue
            set_step_compile_enabled(enabled)
            rows = []
            for step in range(WARMUP + args.steps):
                ids, row = _step(model, caches, ids)
                if step >= WARMUP:
                    rows.append(row)
            results[enabled] += rows
            emit("round", batch=batch, round=round_index, step_compile=enabled, **_medians(rows), steps=rows)
        _summary(batch, results, emit)
    set_step_compile_enabled(at_start)
    emit("done", seconds=round(time.perf_counter() - clock, 2))


def _step(model: DeepseekV4, caches: list, ids: list[int]) -> tuple[list[int], dict]:
    start, start_cpu = time.perf_counter(), time.thread_time()
    logits = model.forward([Segment(c, [t]) for c, t in zip(caches, ids)])
    built, built_cpu = time.perf_counter(), time.thread_time()
    ids = [int(t) for t in mx.argmax(mx.concatenate(logits), axis=-1).tolist()]
    done = time.perf_counter()
    mx.eval([c.arrays() for c in caches])  # evaluated with the logits already; keeps the graphs short
    return ids, {"build_ms": (built - start) * 1e3, "eval_ms": (done - built) * 1e3, "total_ms": (done - start) * 1e3,
                 "build_cpu_ms": (built_cpu - start_cpu) * 1e3}


def _primitives(model: DeepseekV4, caches: list, ids: list[int]) -> dict:
    """Primitives of one whole decode step's graph, by kind (the decode-async switch is off by default:
    nothing is evaluated while the step is built). Advances the caches by one step."""
    logits = model.forward([Segment(c, [t]) for c, t in zip(caches, ids)])
    arrays = list(logits) + [a for c in caches for a in c.arrays()]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *arrays)
        kinds = collections.Counter(re.findall(r'label ?= ?"([^"]*)"[^\]]*shape ?= ?rectangle', path.read_text()))
    mx.eval(arrays)
    ids[:] = [int(t) for t in mx.argmax(mx.concatenate(logits), axis=-1).tolist()]
    return {"total": sum(kinds.values()), "by_kind": dict(kinds.most_common(12))}


def _medians(rows: list[dict]) -> dict[str, float]:
    return {f"{k}_median": round(statistics.median(r[k] for r in rows), 3) for k in rows[0]} if rows else {}


def _summary(batch: int, results: dict[bool, list[dict]], emit) -> None:
    on, off = results.get(True, []), results.get(False, [])
    row = {"batch": batch, "steps_on": len(on), "steps_off": len(off), "on": _medians(on), "off": _medians(off)}
    if on and off:
        row["total_ms_on_over_off"] = round(row["on"]["total_ms_median"] / row["off"]["total_ms_median"], 4)
        for key in ("build_ms", "build_cpu_ms"):
            row[f"{key}_on_over_off"] = round(row["on"][f"{key}_median"] / row["off"][f"{key}_median"], 4)
    emit("summary", **row)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model directory")
    p.add_argument("out", help="JSON lines output")
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--cache-fill", choices=("random", "prefill"), default="random")
    p.add_argument("--budget-s", type=float, default=120.0)
    return p


if __name__ == "__main__":
    main()
