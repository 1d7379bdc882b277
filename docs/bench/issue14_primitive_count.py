"""Primitives (graph nodes) of one decode step, per forward stage, and the step's Python build time.

python docs/bench/issue14_primitive_count.py MODEL_DIR [--batch 1 8] [--ctx 2048] [--steps 40] [--step-compile 0|1] [--dtype bfloat16]
    [--count-steps 4] [--as-cuda]   # one JSON line per batch

--as-cuda counts the CUDA path's graph on a machine without CUDA (docs/bench/cuda_standin.py): every kernel of
kernels/ and every `mx.fast.rms_norm` stood in by one node, counted as the `CustomKernel` or `RMSNorm` it stands
for, the step compiled as on a GPU. Only `build_ms` is timed then (this CPU's Python building the CUDA path's
graph): the stand-ins' evaluation is not the kernels' work. Without it the count is the running device's own path.

--step-compile sets engine/model/compiled.py's fixed-shape step compilation for this run (absent: as
TESSERA_COMPILE_STEP says; the JSON line's `step_compile` records it). With it on, a layer's attention
prologue is counted under "other" and its FFN half (with the expand after attention) under "moe".

Counting: a trace evaluates the graph at every stage boundary (engine/model/trace.py) and counts,
with `mx.export_to_dot`, the primitives built since the previous boundary; the head's are counted
on the logits. Every primitive counts, views (Reshape, Transpose, ExpandDims, Slice, Squeeze,
Broadcast) included: MLX's CUDA backend pays a roughly constant host cost per primitive
(docs/BENCHMARKS.md, "Issue 14, session 6: primitives per decode step"). `sinkhorn_like` is the
part of the count that is the 20-iteration Sinkhorn reference's Sum and fused add/divide nodes
(one CUDA kernel on a GPU, kernels/sinkhorn.py); `total_sinkhorn_as_one` counts each Sinkhorn as one.

--count-steps N counts N consecutive steps (default 1): the JSON line's per-step fields are the first's, and
`step_totals` lists all N. A step whose token closes CSA windows (every fourth) builds more than the others;
with N ≥ 4 `closing_extra` is, by kind, the last such step's count minus an ordinary step's (one whose total is
the steps' median: most steps close nothing), which is what closing adds. With N ≥ 8 the last closing is not the
first after the cache fill, which may also grow buffers that a fill left exactly full.
Counted steps are real steps: each moves the caches on by one token.

Timing (no trace, nothing counted): `build_ms` is the wall time of `model.forward` for one decode
step (the Python that builds the graph), `eval_ms` the evaluation after it; medians over `--steps`
steps after 3 warm-up steps. Caches are random rows of a `ctx`-token prefill's shapes
(engine/tools/cache_fill.py), so any context costs no prefill.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.compiled import set_step_compile_enabled, step_compile_enabled
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.tools.bench_decode import DecodeOptions, _filled

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from docs.bench.cuda_standin import STANDIN_KINDS, cuda_graph_on_cpu  # noqa: E402

# Node kinds of the Sinkhorn reference's iterations (a row sum, a column sum, two fused divides).
SINKHORN_KINDS = ("Sum", "CompiledBroadcastBroadcastAddBroadcastBroadcastDivide")


def primitives(arrays) -> collections.Counter:
    """Primitive kinds in the graph that produces `arrays` (evaluated inputs are leaves, not counted)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        kinds = re.findall(r'label ?= ?"([^"]*)"[^\]]*shape ?= ?rectangle', path.read_text())
        return collections.Counter(STANDIN_KINDS.get(kind, kind) for kind in kinds)


class CountingTrace(ForwardTrace):
    """Counts each stage's primitives, then evaluates so the next stage counts only its own."""

    def __init__(self) -> None:
        super().__init__(stage_sync=False)
        self.kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def stage(self, name: str, *arrays: mx.array) -> mx.array:
        self.kinds[name].update(primitives(arrays))
        mx.eval(*arrays)
        return arrays[0]

    boundary = stage


def step(model, caches, token_ids, timer=None) -> list[int]:
    logits = model.forward([Segment(c, [t]) for c, t in zip(caches, token_ids)], timer=timer)
    return mx.argmax(mx.concatenate(logits), axis=-1).tolist()


def count_step(model, caches, token_ids) -> tuple[dict, list[int]]:
    """One real decode step, counted -> (its counts, the greedy next token ids)."""
    trace = CountingTrace()
    logits = model.forward([Segment(c, [t]) for c, t in zip(caches, token_ids)], timer=trace)
    trace.kinds["head"].update(primitives(logits))
    mx.eval(logits, [c.arrays() for c in caches])
    next_ids = mx.argmax(mx.concatenate(logits), axis=-1).tolist()
    per_stage = {name: sum(c.values()) for name, c in trace.kinds.items()}
    by_kind = sum(trace.kinds.values(), collections.Counter())
    sinkhorn_like = sum(by_kind[k] for k in SINKHORN_KINDS)
    num_sinkhorns = 2 * len(model.layer_ids)
    total = sum(per_stage.values())
    counts = {"total": total, "sinkhorn_like": sinkhorn_like,
              "total_sinkhorn_as_one": total - sinkhorn_like + num_sinkhorns if sinkhorn_like else total,
              "per_stage": per_stage, "by_kind": dict(by_kind.most_common()),
              "per_stage_by_kind": {n: dict(c.most_common()) for n, c in trace.kinds.items()}}
    return counts, next_ids


def closing_extra(counted: list[dict]) -> dict:
    """Counted consecutive steps -> {"closing_extra": by kind, the last step above the median count minus a step
    at the median} (empty for fewer than 4 steps: none need close a window)."""
    if len(counted) < 4:
        return {}
    typical = statistics.median_low([c["total"] for c in counted])
    ordinary = next(c for c in counted if c["total"] == typical)
    closing = [c for c in counted if c["total"] > typical][-1]
    extra = collections.Counter(closing["by_kind"])
    extra.subtract(ordinary["by_kind"])
    return {"closing_extra": {kind: n for kind, n in extra.most_common() if n}}


def time_steps(model, caches, token_ids, steps: int) -> dict:
    build, evaluate = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        logits = model.forward([Segment(c, [t]) for c, t in zip(caches, token_ids)])
        t1 = time.perf_counter()
        token_ids = mx.argmax(mx.concatenate(logits), axis=-1).tolist()
        mx.eval([c.arrays() for c in caches])
        t2 = time.perf_counter()
        if i >= 3:
            build.append(1e3 * (t1 - t0))
            evaluate.append(1e3 * (t2 - t1))
    return {"build_ms_median": statistics.median(build), "eval_ms_median": statistics.median(evaluate),
            "build_ms_p90": sorted(build)[int(0.9 * (len(build) - 1))], "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", type=Path)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--label", default="")
    p.add_argument("--step-compile", type=int, choices=(0, 1), default=None)
    p.add_argument("--count-steps", type=int, default=1, help="consecutive steps counted (≥ 4 shows a closing step)")
    p.add_argument("--dtype", default=None, help="load the weights in this dtype (bfloat16: the casts a GPU model runs)")
    p.add_argument("--as-cuda", action="store_true", help="count the CUDA path's graph on this CPU (build time only)")
    args = p.parse_args()
    with cuda_graph_on_cpu() if args.as_cuda else contextlib.nullcontext():
        count(args)


def count(args: argparse.Namespace) -> None:
    """One JSON line per batch size: the counted steps and the timing (module docstring)."""
    if args.step_compile is not None:
        set_step_compile_enabled(bool(args.step_compile))
    model = load_model(args.model_dir, dtype=args.dtype) if args.dtype else load_model(args.model_dir)
    for batch in args.batch:
        caches = [_filled(model, args.ctx, b, DecodeOptions(1024, 256, cache_fill="random")) for b in range(batch)]
        token_ids = [1] * batch
        for _ in range(2):  # the first steps build lazily cached weights (HyperWeights' cached forms)
            token_ids = step(model, caches, token_ids)
            mx.eval([c.arrays() for c in caches])
        counted = []
        for _ in range(args.count_steps):
            counts, token_ids = count_step(model, caches, token_ids)
            counted.append(counts)
        counts = {**counted[0], "step_totals": [c["total"] for c in counted], **closing_extra(counted)}
        timing = time_steps(model, caches, token_ids, args.steps)
        if args.as_cuda:  # the stand-ins' evaluation is not the kernels' work; building the graph is this path's
            timing = {k: v for k, v in timing.items() if not k.startswith("eval_")}
        device = "cuda path on the cpu (stand-in kernels)" if args.as_cuda else str(mx.default_device())
        print(json.dumps({"label": args.label, "model": str(args.model_dir), "device": device, "batch": batch,
                          "ctx": args.ctx, "step_compile": step_compile_enabled(), **timing, **counts}), flush=True)


if __name__ == "__main__":
    main()
