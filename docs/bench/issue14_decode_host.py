"""Issue 14, session 6: where a batch-1 decode step's time goes between the host (Python building the MLX
graph) and the device, with the per-layer early start of decode steps on and off (engine/model/decode_async.py,
TESSERA_DECODE_ASYNC), for `model.forward` and for the serving path (`ModelRunner.execute` of a decode-only
StepPlan). docs/BENCHMARKS.md, "Issue 14, session 6: the host cost of a decode step".

python docs/bench/issue14_decode_host.py MODEL_DIR OUT.jsonl [--ctx 65536] [--cache-fill prefill|random] [--steps 30]

H200 (the model as loaded: the official checkpoint's FP8 / FP4 weights, not dequantized):
  python -m tessera.engine.tools.commands make-model /dev/shm/fw --preset flash-width --format official --no-tokenizer
  python docs/bench/issue14_decode_host.py /dev/shm/fw docs/bench/issue14-decode-host-h200.jsonl --cache-fill random
CPU (the same code path at small sizes):
  python docs/bench/issue14_decode_host.py /tmp/small OUT.jsonl --ctx 2048 --chunk 1024 --tile 256 --steps 10 --cache-fill random

One sequence's cache is filled to --ctx (a chunked, tiled prefill, or `random`: random rows of a prefill's
shapes, engine/tools/cache_fill.py); then, per path, rounds of --steps timed decode steps (2 untimed warm-up
steps each) with the switch in the order on off off on. Per step:
- forward path: `build_ms` = until `model.forward` returns (with the switch on, the layers already started
  run on the device meanwhile); `eval_ms` = from there until the greedy next id is on the host; `total_ms`.
  Nothing else is evaluated between steps (cache rows not needed by the logits are evaluated by the next step,
  as in serving).
- runner path: `total_ms` = `execute(plan)`; `forward_ms` = the model.forward inside it; `eval_ms` = the
  time blocked in `mx.eval` (the sampler's one sync); `serving_ms` = the rest (plan bookkeeping, cache
  snapshot for rollback, logits slicing, sampling's host side).
Also: the graph nodes of one step (switch off, so the whole step is one graph; `mx.export_to_dot`).
One JSON line per measurement to OUT.jsonl (also stdout, shortened); progress on stderr. Budget: after the
model is loaded the script stops starting rounds once --budget-s (90) is spent and says so.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
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

from tessera.kernels.shapeless import compile_enabled  # noqa: E402
from tessera.engine.model.decode_async import decode_async_enabled, set_decode_async_enabled  # noqa: E402
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment  # noqa: E402
from tessera.engine.model.dtypes import dtype_name  # noqa: E402
from tessera.engine.model.loader import load_model  # noqa: E402
from tessera.engine.model.quantized import QuantizedWeight  # noqa: E402
from tessera.engine.serving.protocol import DecodeSlot, SamplingParams, StepPlan  # noqa: E402
from tessera.engine.serving.runner import ModelRunner  # noqa: E402
from tessera.engine.tools.bench_decode import CACHE_FILLS, DecodeOptions, _filled  # noqa: E402

ORDER = (True, False, False, True)  # the switch per round: on off off on
WARMUP = 2
REQUEST = "bench"


def main() -> None:
    args = _parser().parse_args()
    out = open(args.out, "w")
    clock = time.perf_counter()

    def emit(what: str, **row) -> None:
        line = json.dumps({"what": what, "seconds": round(time.perf_counter() - clock, 2), **row})
        out.write(line + "\n")
        out.flush()
        print(line[:240], flush=True)

    emit("start", device=str(mx.default_device()), mlx=mx.__version__, ctx=args.ctx, cache_fill=args.cache_fill,
         steps=args.steps, chunk=args.chunk, tile=args.tile, compile=compile_enabled(), decode_async_at_start=decode_async_enabled(),
         env={k: v for k, v in os.environ.items() if k.startswith(("MLX_", "TESSERA_"))})
    model = load_model(Path(args.model))
    formats = collections.Counter(f"{w.mode}{w.bits}" if isinstance(w, QuantizedWeight) else str(w.dtype) for w in model.weights.values())
    emit("loaded", load_seconds=round(time.perf_counter() - clock, 2), dtype=dtype_name(model.dtype), tensors_by_format=dict(formats))
    clock = time.perf_counter()  # the budget counts from here
    at_start = decode_async_enabled()
    deadline = clock + args.budget_s
    cache = _filled(model, args.ctx, 0, DecodeOptions(args.chunk, args.tile, cache_fill=args.cache_fill))
    mx.eval(cache.arrays())
    emit("cache_filled", num_tokens=cache.num_tokens)
    next_id = [1]
    emit("graph_nodes", batch=1, nodes=_step_nodes(model, cache, next_id))
    results: dict[tuple[str, bool], list[dict]] = collections.defaultdict(list)
    forward_round = lambda: _forward_steps(model, cache, next_id, args.steps)  # noqa: E731
    runner = _runner(model, cache, args)
    runner_round = lambda: _runner_steps(runner, next_id, args.steps)  # noqa: E731
    for path, run_round in (("forward", forward_round), ("runner", runner_round)):
        for round_index, enabled in enumerate(ORDER):
            if time.perf_counter() > deadline:
                emit("skipped", path=path, round=round_index, reason=f"--budget-s {args.budget_s} spent")
                continue
            set_decode_async_enabled(enabled)
            steps = run_round()
            results[(path, enabled)] += steps
            emit("round", path=path, round=round_index, decode_async=enabled, **_medians(steps), steps=steps)
            _log(f"{path} round {round_index} (async {'on' if enabled else 'off'}): {_medians(steps)}")
    set_decode_async_enabled(at_start)
    _summary(results, emit)
    emit("done", seconds_after_load=round(time.perf_counter() - clock, 2))


def _forward_steps(model: DeepseekV4, cache, next_id: list[int], steps: int) -> list[dict]:
    rows = []
    for step in range(WARMUP + steps):
        start = time.perf_counter()
        logits = model.forward([Segment(cache, next_id[:])])
        built = time.perf_counter()
        next_id[0] = int(mx.argmax(logits[0], axis=-1).item())
        done = time.perf_counter()
        if step >= WARMUP:
            rows.append({"build_ms": (built - start) * 1e3, "eval_ms": (done - built) * 1e3, "total_ms": (done - start) * 1e3})
    return rows


def _runner(model: DeepseekV4, cache, args) -> ModelRunner:
    """A runner holding one request whose cache is the filled one (as if its prompt had been prefilled)."""
    # the serial step these runs measured (plans read positions off the cache)
    runner = ModelRunner(
        model, prefill_chunk=args.chunk, indexer_tile=args.tile, max_context=args.ctx + 4096, decode_overlap=False
    )
    runner.add_request(REQUEST, [1], SamplingParams(temperature=0.0, max_tokens=10**9))
    runner._sequences[REQUEST].cache = cache  # noqa: SLF001 - a benchmark's shortcut past the prefill
    return runner


class _Spans:
    """Time spent inside wrapped callables (model.forward, mx.eval) during one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed


def _runner_steps(runner: ModelRunner, next_id: list[int], steps: int) -> list[dict]:
    spans, real_eval, model = _Spans(), mx.eval, runner.model
    model.forward = spans.wrap("forward", DeepseekV4.forward.__get__(model))
    mx.eval = spans.wrap("eval", real_eval)
    rows = []
    try:
        for step in range(WARMUP + steps):
            position = runner._sequences[REQUEST].cache.num_tokens  # noqa: SLF001
            plan = StepPlan(decodes=(DecodeSlot(REQUEST, next_id[0], position),))
            spans.seconds.clear()
            start = time.perf_counter()
            output = runner.execute(plan)
            total = time.perf_counter() - start
            next_id[0] = output.sampled[0].token_id
            if step >= WARMUP:
                forward, blocked = spans.seconds["forward"], spans.seconds["eval"]
                rows.append({"total_ms": total * 1e3, "forward_ms": forward * 1e3, "eval_ms": blocked * 1e3,
                             "serving_ms": (total - forward - blocked) * 1e3})
    finally:
        mx.eval = real_eval
        del model.forward
    return rows


def _step_nodes(model: DeepseekV4, cache, next_id: list[int]) -> int:
    """Primitives in one decode step's graph (the switch off: nothing is evaluated while it is built)."""
    before = decode_async_enabled()
    set_decode_async_enabled(False)
    try:
        logits = model.forward([Segment(cache, next_id[:])])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "step.dot"
            mx.export_to_dot(str(path), *logits)
            nodes = len(re.findall(r"shape=rectangle", path.read_text()))
        next_id[0] = int(mx.argmax(logits[0], axis=-1).item())
        mx.eval(cache.arrays())
    finally:
        set_decode_async_enabled(before)
    return nodes


def _medians(rows: list[dict]) -> dict[str, float]:
    return {f"{k}_median": round(statistics.median(r[k] for r in rows), 3) for k in rows[0]} if rows else {}


def _summary(results: dict[tuple[str, bool], list[dict]], emit) -> None:
    for path in ("forward", "runner"):
        on, off = results.get((path, True), []), results.get((path, False), [])
        row = {"path": path, "steps_on": len(on), "steps_off": len(off),
               "async_on": _medians(on), "async_off": _medians(off)}
        if on and off:
            a, b = statistics.median(r["total_ms"] for r in on), statistics.median(r["total_ms"] for r in off)
            row["total_ms_on_over_off"] = round(a / b, 4)
        emit("summary", **row)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model dir (make-model --preset flash-width --format official on the H200)")
    p.add_argument("out", help="JSON lines file")
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--cache-fill", choices=CACHE_FILLS, default="prefill")
    p.add_argument("--steps", type=int, default=30, help="timed steps per round (4 rounds per path)")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=90.0, help="no new round starts after this many seconds past loading")
    return p


if __name__ == "__main__":
    main()
