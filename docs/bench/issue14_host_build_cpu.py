"""Issue 14, session 6: the Python cost of building one decode step, on the CPU (docs/BENCHMARKS.md,
"Issue 14, session 6: the host cost of a decode step").

python docs/bench/issue14_host_build_cpu.py MODEL_DIR [--ctx 2048] [--steps 20] [--label NAME]   # JSON lines on stdout

Per setting, in the order f1 f8 r1 r8 r8 r1 f8 f1 (f = `model.forward`, r = `ModelRunner.execute` of a
decode-only StepPlan; 1 / 8 = sequences per step), rounds of --steps steps after 3 warm-up steps:
- forward: `build_ms`, the time `model.forward` takes to return (nothing is evaluated inside it with the
  decode-async switch off, which this script sets where it exists: pure graph building);
- runner: `host_ms`, the execute() time minus the time spent blocked in `mx.eval` (the sampler's one sync),
  and `forward_build_ms`, the model.forward inside it.
`*_cpu_ms`: the same spans in this thread's CPU time (time.thread_time), which a machine shared with other
processes disturbs far less than wall time.
Runs on any checkout of this repository since Issue 14's bench decode (before and after session 6): put the
checkout under test first on PYTHONPATH and compare processes in A B B A order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.serving.protocol import DecodeSlot, SamplingParams, StepPlan
from tessera.engine.serving.runner import ModelRunner
from tessera.engine.tools.bench_decode import DecodeOptions, _filled

ORDER = ["f1", "f8", "r1", "r8", "r8", "r1", "f8", "f1"]


class EvalClock:
    """Wraps mx.eval: the seconds (wall, and this thread's CPU) the host spends in it."""

    def __init__(self) -> None:
        self.seconds, self.cpu_seconds, self._real = 0.0, 0.0, mx.eval
        mx.eval = self._eval

    def _eval(self, *args):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._real(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", type=Path)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--label", default="")
    args = p.parse_args()
    try:
        from tessera.engine.model.decode_async import set_decode_async_enabled

        set_decode_async_enabled(False)  # forward's time is then graph building only
    except ImportError:  # a checkout from before the switch: nothing is evaluated inside forward anyway
        pass
    model = load_model(args.model_dir)
    caches = [_filled(model, args.ctx, b, DecodeOptions(1024, 256, cache_fill="random")) for b in range(8)]
    runners = {b: _runner(model, args.ctx, b) for b in (1, 8)}
    clock = EvalClock()
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in set(ORDER)}
    for setting in ORDER:
        batch = int(setting[1:])
        if setting[0] == "f":
            rows = _forward_round(model, caches[:batch], args.steps)
        else:
            rows = _runner_round(runners[batch], clock, args.steps)
        for key, values in rows.items():
            samples[setting].setdefault(key, []).extend(values)
        print(f"{setting} done", file=sys.stderr, flush=True)
    for setting in sorted(samples):
        row = {"label": args.label, "setting": setting, "path": "forward" if setting[0] == "f" else "runner",
               "batch": int(setting[1:]), "ctx": args.ctx, "steps": len(next(iter(samples[setting].values())))}
        row.update({f"{k}_median": statistics.median(v) for k, v in samples[setting].items()})
        print(json.dumps(row), flush=True)


def _forward_round(model, caches, steps: int) -> dict[str, list[float]]:
    ids, builds, cpus = [1] * len(caches), [], []
    for step in range(3 + steps):
        segments = [Segment(c, [t]) for c, t in zip(caches, ids)]
        start, cpu = time.perf_counter(), time.thread_time()
        logits = model.forward(segments)
        built, built_cpu = time.perf_counter() - start, time.thread_time() - cpu
        ids = mx.argmax(mx.concatenate(logits), axis=-1).tolist()
        mx.eval([c.arrays() for c in caches])
        if step >= 3:
            builds.append(built * 1000)
            cpus.append(built_cpu * 1000)
    return {"build_ms": builds, "build_cpu_ms": cpus}


def _runner(model, ctx: int, batch: int) -> ModelRunner:
    runner = ModelRunner(model, prefill_chunk=1024, indexer_tile=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=10**9)
    for b in range(batch):
        runner.add_request(f"r{b}", [1, 2, 3], greedy)
        runner._sequences[f"r{b}"].cache = _filled(model, ctx, 100 + b, DecodeOptions(1024, 256, cache_fill="random"))
    runner.next_ids = {f"r{b}": 1 for b in range(batch)}
    return runner


def _runner_round(runner: ModelRunner, clock: EvalClock, steps: int) -> dict[str, list[float]]:
    real_forward = runner.model.forward
    forward_seconds = [0.0]

    def timed_forward(*a, **k):
        start = time.perf_counter()
        try:
            return real_forward(*a, **k)
        finally:
            forward_seconds[0] += time.perf_counter() - start

    runner.model.forward = timed_forward
    host, host_cpu, build = [], [], []
    try:
        for step in range(3 + steps):
            plan = StepPlan(decodes=tuple(DecodeSlot(r, t, runner._sequences[r].cache.num_tokens) for r, t in runner.next_ids.items()))
            clock.seconds, clock.cpu_seconds, forward_seconds[0] = 0.0, 0.0, 0.0
            start, cpu = time.perf_counter(), time.thread_time()
            out = runner.execute(plan)
            total, total_cpu = time.perf_counter() - start, time.thread_time() - cpu
            runner.next_ids = {s.request_id: s.token_id for s in out.sampled}
            if step >= 3:
                host.append((total - clock.seconds) * 1000)
                host_cpu.append((total_cpu - clock.cpu_seconds) * 1000)
                build.append(forward_seconds[0] * 1000)
    finally:
        del runner.model.forward
    return {"host_ms": host, "host_cpu_ms": host_cpu, "forward_build_ms": build}


if __name__ == "__main__":
    main()
