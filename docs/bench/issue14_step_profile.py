"""Per-sequence cost of one decode step (docs/BENCHMARKS.md "Issue 14, session 6"): graph nodes and
the host time spent building the step's graph at several batch sizes, on random caches of a
prefill's shapes.

python docs/bench/issue14_step_profile.py MODEL_DIR [--ctx 2048] [--batch 1 8 16] [--steps 6] [--profile B]

For each batch B: `nodes_logits` (primitives `mx.export_to_dot` finds under the step's logits, the
mean of NODE_STEPS consecutive steps),
`nodes_all` (under the logits and every cache array the step leaves: window and frontier updates
included), `build_ms` (median wall time of `model.forward` returning its lazy logits — Python and
graph construction; nothing in a decode step evaluates before the logits unless a stage syncs),
`eval_ms` (median time to evaluate them and the caches). `--profile B` prints cProfile's top
functions (cumulative) of building B's steps. One JSON line per batch on stdout.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere inside the repo

from tessera.engine.model.deepseek_v4 import Segment  # noqa: E402
from tessera.engine.model.loader import load_model  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled  # noqa: E402

NODE_STEPS = 4  # nodes are the mean of this many consecutive steps: a CSA window (ratio 4) closes in one of them


def primitives(arrays) -> collections.Counter:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *arrays)
        return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', path.read_text()))


def _step(model, caches, ids):
    t0 = time.perf_counter()
    logits = model.forward([Segment(c, [t]) for c, t in zip(caches, ids)])
    built = time.perf_counter() - t0
    return logits, built


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", type=Path)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--profile", type=int, default=None, help="print cProfile of building this batch's steps")
    args = p.parse_args()
    model = load_model(args.model_dir)
    options = DecodeOptions(chunk=1024, tile=256, cache_fill="random")
    caches = [_filled(model, args.ctx, b, options) for b in range(max(args.batch))]
    for batch in args.batch:
        ids = [1] * batch
        for _ in range(2):  # warm-up (first-use compilation, frontier shapes of a decode)
            logits, _ = _step(model, caches[:batch], ids)
            mx.eval(logits, [c.arrays() for c in caches[:batch]])
        nodes_logits, nodes_all = collections.Counter(), collections.Counter()
        for _ in range(NODE_STEPS):
            logits, _ = _step(model, caches[:batch], ids)
            nodes_logits += primitives(logits)
            nodes_all += primitives(list(logits) + [a for c in caches[:batch] for a in c.arrays()])
            mx.eval(logits, [c.arrays() for c in caches[:batch]])
        build, evals = [], []
        profiler = cProfile.Profile() if args.profile == batch else None
        for _ in range(args.steps):
            if profiler:
                profiler.enable()
            logits, built = _step(model, caches[:batch], ids)
            if profiler:
                profiler.disable()
            t0 = time.perf_counter()
            mx.eval(logits, [c.arrays() for c in caches[:batch]])
            evals.append((time.perf_counter() - t0) * 1000)
            build.append(built * 1000)
        per_step = lambda c: round(sum(c.values()) / NODE_STEPS, 1)  # noqa: E731
        print(json.dumps({"ctx": args.ctx, "batch": batch, "nodes_logits": per_step(nodes_logits),
                          "nodes_all": per_step(nodes_all), "build_ms": round(statistics.median(build), 2),
                          "eval_ms": round(statistics.median(evals), 2), "build_ms_all": [round(b, 2) for b in build],
                          "by_primitive": {k: v / NODE_STEPS for k, v in nodes_all.most_common()}}), flush=True)
        if profiler:
            s = io.StringIO()
            pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(40)
            print(s.getvalue(), file=sys.stderr)


if __name__ == "__main__":
    main()
