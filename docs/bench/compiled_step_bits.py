"""Do compiled decode steps (TESSERA_COMPILE_STEP) give the plain steps' bits on this device, at real widths?
Do stacked input projections (TESSERA_STACKED_INPUTS, `--switch stacked_inputs`)? And what does the server's
start-up warm-up of every decode batch size cost?

python docs/bench/compiled_step_bits.py MODEL OUT.jsonl [--switch compile|stacked_inputs] [--ctx 16384]
    [--batches 1 16] [--steps 6] [--warm-up 16]

For each batch size B: B caches of `ctx` random rows (engine/tools/cache_fill.py, seeded per sequence), `steps`
greedy decode steps with the switch off; the same caches made again, the same steps with it on. One line
per B: the largest difference of the logits and of the caches (0.0 = the same bits) and whether the tokens
match. tests/equivalence/test_step_compiled.py checks this on the CPU at tiny widths, where
kernels/gather_qmv.py's kernel does not apply; this runs the checkpoint as loaded (mxfp4 experts through the
kernel, the decode MoE's pairs in order). Then, with --warm-up N, engine/serving/warm_up.py's warm-up of batch
sizes 1..N as `tessera serve` runs it at start-up, with its seconds per batch size (sizes traced above are
already warm).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.probe_io import jsonl_emitter, load_probe_model  # noqa: E402
from tessera.engine.model import attention  # noqa: E402
from tessera.engine.model.compiled import set_step_compile_enabled, step_compile_enabled  # noqa: E402
from tessera.engine.model.deepseek_v4 import Segment  # noqa: E402
from tessera.engine.serving.warm_up import warm_up_decode  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled  # noqa: E402


# --switch name -> (read it, set it)
SWITCHES = {"compile": (step_compile_enabled, set_step_compile_enabled),
            "stacked_inputs": (attention.stacked_inputs_enabled, attention.set_stacked_inputs_enabled)}


def decode(model, ctx: int, batch: int, steps: int, switch: str, on: bool):
    SWITCHES[switch][1](on)
    caches = [_filled(model, ctx, b, DecodeOptions(chunk=4096, tile=1024, cache_fill="random")) for b in range(batch)]
    ids, logits, tokens = [1] * batch, [], []
    for _ in range(steps):
        step = mx.concatenate(model.forward([Segment(c, [t]) for c, t in zip(caches, ids)]))
        ids = mx.argmax(step, axis=-1).tolist()
        logits.append(np.array(step.astype(mx.float32)))
        tokens.append(ids)
    return logits, tokens, [np.array(a.astype(mx.float32)) for c in caches for a in c.arrays()]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) if x.size else 0.0 for x, y in zip(a, b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--switch", choices=sorted(SWITCHES), default="compile")
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warm-up", type=int, default=0, help="then time the start-up warm-up of batch sizes 1..N")
    args = p.parse_args()
    emit = jsonl_emitter(args.out)
    model = load_probe_model(args.model, as_loaded=True)
    read, put = SWITCHES[args.switch]
    saved = read()
    for batch in args.batches:
        t0 = time.perf_counter()
        off_logits, off_tokens, off_caches = decode(model, args.ctx, batch, args.steps, args.switch, on=False)
        on_logits, on_tokens, on_caches = decode(model, args.ctx, batch, args.steps, args.switch, on=True)
        emit("bits", switch=args.switch, batch=batch, ctx=args.ctx, steps=args.steps, tokens_equal=off_tokens == on_tokens,
             logits_max_abs_diff=max_diff(off_logits, on_logits),
             caches_max_abs_diff=max_diff(off_caches, on_caches), seconds=time.perf_counter() - t0)
    put(saved)
    if args.warm_up:
        set_step_compile_enabled(True)
        warm = warm_up_decode(model, range(1, args.warm_up + 1))
        emit("warm_up", sizes=args.warm_up, total_seconds=warm.total_seconds, seconds=dict(warm.seconds),
             traced_before=args.batches)
    set_step_compile_enabled(False)


if __name__ == "__main__":
    main()
