"""Issue 14, session 6: the Python cost of building one decode step, two checkouts compared in lockstep on the
CPU (docs/BENCHMARKS.md, "Issue 14, session 6: the host cost of a decode step").

python docs/bench/issue14_host_build_cpu.py MODEL_DIR OUT.jsonl --checkout before=PATH --checkout after=PATH \\
    [--ctx 2048] [--rounds 8] [--steps 5]

Each PATH is a PYTHONPATH entry whose `tessera` is the checkout to measure (a link tree: README.md). One
worker process per checkout (this file with --worker) loads the model and fills 8 caches to --ctx (random
rows), then the controller asks the workers for rounds of --steps steps (after 2 warm-up steps) per setting,
the workers taking turns (A B, then B A, ...): load drifting on a shared machine hits both alike. Settings:
f1, f8 = `model.forward` with 1 / 8 sequences; r1, r8 = `ModelRunner.execute` of a decode-only StepPlan.
- forward: `build_ms` = until `model.forward` returns (the decode-async switch is set off where it exists,
  so nothing is evaluated inside it: graph building only);
- runner: `host_ms` = execute() minus the time blocked in `mx.eval` (the sampler's one sync), and
  `forward_build_ms`, the model.forward inside it;
`*_cpu_ms`: the same spans in the worker thread's CPU time (time.thread_time), which other processes on
the machine disturb less than wall time. One JSON line per round to OUT.jsonl, then per checkout and
setting the median and 10th percentile of every measure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = ("f1", "f8", "r1", "r8")
WARMUP = 2


# ---- controller --------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", type=Path)
    p.add_argument("out", nargs="?")
    p.add_argument("--checkout", action="append", default=[], help="LABEL=PYTHONPATH (two of them)")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args.model_dir, args.ctx)
    checkouts = dict(c.split("=", 1) for c in args.checkout)
    if len(checkouts) != 2 or not args.out:
        p.error("give OUT.jsonl and exactly two --checkout LABEL=PYTHONPATH")
    workers = {label: _start(path, args) for label, path in checkouts.items()}
    labels = list(workers)
    out, samples = open(args.out, "w"), {}
    for r in range(args.rounds):
        for setting in SETTINGS:
            for label in (labels if r % 2 == 0 else labels[::-1]):
                row = _ask(workers[label], f"{setting} {args.steps}")
                out.write(json.dumps({"what": "round", "label": label, "round": r, **row}) + "\n")
                for key, values in row["times"].items():
                    samples.setdefault((label, setting, key), []).extend(values)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for w in workers.values():
        w.stdin.close()
        w.wait(timeout=60)
    for (label, setting, key), values in sorted(samples.items()):
        line = {"what": "summary", "label": label, "setting": setting, "measure": key, "steps": len(values),
                "median": statistics.median(values), "p10": _p10(values)}
        out.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)


def _start(path: str, args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, __file__, str(args.model_dir), "--worker", "--ctx", str(args.ctx)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", f"worker for {path} did not start"
    return proc


def _ask(proc: subprocess.Popen, command: str) -> dict:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def _p10(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(0.1 * len(ordered)) - 1)]


# ---- worker (imports the checkout under test) ----------------------------------------------------


def _worker(model_dir: Path, ctx: int) -> None:
    import mlx.core as mx

    from tessera.engine.model.loader import load_model
    from tessera.engine.tools.bench_decode import DecodeOptions, _filled

    try:
        from tessera.engine.model.decode_async import set_decode_async_enabled

        set_decode_async_enabled(False)  # forward's time is then graph building only
    except ImportError:  # a checkout from before the switch: nothing is evaluated inside forward anyway
        pass
    model = load_model(model_dir)
    fill = DecodeOptions(1024, 256, cache_fill="random")
    caches = [_filled(model, ctx, b, fill) for b in range(8)]
    runners = {b: _runner(model, ctx, b, fill) for b in (1, 8)}
    clock = _EvalClock(mx)
    state = {"ids": [1] * 8}
    print("ready", flush=True)
    for line in sys.stdin:
        setting, steps = line.split()
        batch, steps = int(setting[1:]), int(steps)
        if setting[0] == "f":
            times = _forward_round(mx, model, caches[:batch], state, steps)
        else:
            times = _runner_round(mx, runners[batch], clock, steps)
        print(json.dumps({"setting": setting, "times": times}), flush=True)


class _EvalClock:
    """Wraps mx.eval: the seconds (wall, and this thread's CPU) the host spends in it."""

    def __init__(self, mx) -> None:
        self.seconds, self.cpu_seconds, self._real = 0.0, 0.0, mx.eval
        mx.eval = self._eval

    def _eval(self, *args):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._real(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu


def _forward_round(mx, model, caches, state, steps: int) -> dict[str, list[float]]:
    from tessera.engine.model.deepseek_v4 import Segment

    builds, cpus = [], []
    for step in range(WARMUP + steps):
        ids = state["ids"][: len(caches)]
        segments = [Segment(c, [t]) for c, t in zip(caches, ids)]
        start, cpu = time.perf_counter(), time.thread_time()
        logits = model.forward(segments)
        built, built_cpu = time.perf_counter() - start, time.thread_time() - cpu
        state["ids"][: len(caches)] = mx.argmax(mx.concatenate(logits), axis=-1).tolist()
        mx.eval([c.arrays() for c in caches])
        if step >= WARMUP:
            builds.append(built * 1000)
            cpus.append(built_cpu * 1000)
    return {"build_ms": builds, "build_cpu_ms": cpus}


def _runner(model, ctx: int, batch: int, fill):
    from tessera.engine.serving.protocol import SamplingParams
    from tessera.engine.serving.runner import ModelRunner
    from tessera.engine.tools.bench_decode import _filled

    # the serial step these runs measured (plans read positions off the cache)
    runner = ModelRunner(model, prefill_chunk=1024, indexer_tile=256, decode_overlap=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=10**9)
    for b in range(batch):
        runner.add_request(f"r{b}", [1, 2, 3], greedy)
        runner._sequences[f"r{b}"].cache = _filled(model, ctx, 100 + b, fill)  # noqa: SLF001 - past the prefill
    runner.next_ids = {f"r{b}": 1 for b in range(batch)}
    return runner


def _runner_round(mx, runner, clock: _EvalClock, steps: int) -> dict[str, list[float]]:
    from tessera.engine.serving.protocol import DecodeSlot, StepPlan

    real_forward, forward_seconds = runner.model.forward, [0.0]

    def timed_forward(*a, **k):
        start = time.perf_counter()
        try:
            return real_forward(*a, **k)
        finally:
            forward_seconds[0] += time.perf_counter() - start

    runner.model.forward = timed_forward
    host, host_cpu, build = [], [], []
    try:
        for step in range(WARMUP + steps):
            plan = StepPlan(decodes=tuple(DecodeSlot(r, t, runner._sequences[r].cache.num_tokens)  # noqa: SLF001
                                          for r, t in runner.next_ids.items()))
            clock.seconds, clock.cpu_seconds, forward_seconds[0] = 0.0, 0.0, 0.0
            start, cpu = time.perf_counter(), time.thread_time()
            out = runner.execute(plan)
            total, total_cpu = time.perf_counter() - start, time.thread_time() - cpu
            runner.next_ids = {s.request_id: s.token_id for s in out.sampled}
            if step >= WARMUP:
                host.append((total - clock.seconds) * 1000)
                host_cpu.append((total_cpu - clock.cpu_seconds) * 1000)
                build.append(forward_seconds[0] * 1000)
    finally:
        del runner.model.forward
    return {"host_ms": host, "host_cpu_ms": host_cpu, "forward_build_ms": build}


if __name__ == "__main__":
    main()
