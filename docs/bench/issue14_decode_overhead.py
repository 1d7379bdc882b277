"""Issue 14, decode overhead: batch-1 decode steps with the compiled model functions on and off
(kernels/shapeless.py, TESSERA_COMPILE) and the CUDA Sinkhorn kernel on and off (kernels/sinkhorn.py,
TESSERA_SINKHORN_KERNEL) in alternating rounds in one process, against the bytes floor bench_decode
computes (docs/BENCHMARKS.md, "Issue 14: decode overhead (hyper-connections, compile)").

python docs/bench/issue14_decode_overhead.py MODEL_DIR OUT.jsonl [--ctx 65536] [--steps 16] [--no-quantized] [--cache-fill random]

MODEL_DIR: `make-model --preset flash-width --format official` (on the H200). The model runs first
"dequantized" (quantized weights dequantized to bf16, as docs/bench/issue14_h200.py does; a plain
checkpoint runs as it is), then "as-loaded" (FP8 dense, FP4 experts) if the time budget allows. First the Sinkhorn kernel is checked against its reference (bit-equal);
if it fails it is switched off and the run goes on. Per model: prefill batch 1 to --ctx (chunk 4096,
tile 1024), count the graph nodes of one decode step per arm, then rounds of --steps timed steps
each (2 warm-up steps per round, not timed) in the order A B C C B A, A = compiled + kernel,
B = plain (compilation off), C = compiled without the kernel. One JSON line per measurement to OUT.jsonl
(and stdout), progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from tessera.kernels.shapeless import compile_enabled, set_compile_enabled
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment
from tessera.engine.model.dtypes import dtype_name
from tessera.engine.model.loader import load_model
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.tools.bench_decode import DecodeOptions, _decode_step, _filled, cache_bytes_read, copy_bandwidth, weights_bytes_touched
from tessera.engine.tools.quant_bench import _dequantized_model
from tessera.kernels import sinkhorn as sinkhorn_kernels

# arm -> (compilation, Sinkhorn kernel); rounds in the order A B C C B A
ARMS = {"compiled+kernel": (True, True), "plain": (False, False), "compiled": (True, False)}
ORDER = ["compiled+kernel", "plain", "compiled", "compiled", "plain", "compiled+kernel"]

QUANTIZED_DEADLINE_S = 95.0  # start the quantized model only if this little of the ~3-minute budget is spent


def main() -> None:
    args = _parse()
    start = time.perf_counter()
    out = open(args.out, "w")

    def emit(what: str, **row) -> None:
        line = json.dumps({"what": what, "seconds_since_start": round(time.perf_counter() - start, 2), **row})
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()

    emit("device", device=str(mx.default_device()), mlx=mx.__version__, ctx=args.ctx, steps=args.steps,
         chunk=args.chunk, tile=args.tile, compile_at_start=compile_enabled())
    loaded = load_model(Path(args.model_dir))
    model = _dequantized_model(loaded, mx.bfloat16)
    _log(f"loaded + dequantized in {time.perf_counter() - start:.1f} s")
    emit("sinkhorn_kernel_check", **check_sinkhorn_kernel())
    run_model(model, "dequantized", args, emit)
    del model
    if args.no_quantized:
        emit("skipped", model="as-loaded", reason="--no-quantized")
    elif time.perf_counter() - start > QUANTIZED_DEADLINE_S:
        emit("skipped", model="as-loaded", reason=f"{time.perf_counter() - start:.0f} s spent before it (> {QUANTIZED_DEADLINE_S} s)")
    else:
        run_model(loaded, "as-loaded", args, emit)
    _set_arm("compiled+kernel")
    emit("done", total_seconds=time.perf_counter() - start)


def run_model(model: DeepseekV4, name: str, args, emit) -> None:
    t0 = time.perf_counter()
    cache = _filled(model, args.ctx, 0, DecodeOptions(args.chunk, args.tile, cache_fill=args.cache_fill))
    mx.synchronize()
    emit("prefill", model=name, dtype=dtype_name(model.dtype), ctx=args.ctx, cache_fill=args.cache_fill, seconds=time.perf_counter() - t0)
    ids = [1]
    nodes = {}
    for arm in ARMS:  # node counts of one (then evaluated) step each
        _set_arm(arm)
        logits = model.forward([Segment(cache, ids)])
        nodes[arm] = _node_count(logits)
        ids = [int(mx.argmax(logits[0], axis=-1).item())]
        mx.eval(cache.arrays())
    emit("graph_nodes", model=name, batch=1, nodes=nodes)
    rounds = []
    for arm in ORDER:
        _set_arm(arm)
        ids, steps = _round(model, cache, ids, args.steps)
        rounds.append((arm, steps))
        emit("decode_round", model=name, arm=arm, step_ms_median=statistics.median(steps), step_ms_p90=_p90(steps), step_ms=steps)
    _summary(model, name, cache, rounds, emit)


def _set_arm(arm: str) -> None:
    compiled, kernel = ARMS[arm]
    set_compile_enabled(compiled)
    sinkhorn_kernels.set_kernel_enabled(kernel and _kernel_ok["ok"])


_kernel_ok = {"ok": True}


def check_sinkhorn_kernel() -> dict:
    """The CUDA Sinkhorn kernel against its ordered reference on this device; off for the run if it fails."""
    probs = mx.softmax(mx.random.normal((37, 4, 4), key=mx.random.key(0)) * 3, axis=-1)
    if not sinkhorn_kernels.is_supported(probs):
        _kernel_ok["ok"] = False
        return {"supported": False}
    try:
        got = sinkhorn_kernels.mixing_kernel(probs, 20, 1e-6, mx.float32)
        want = sinkhorn_kernels.mixing_ordered(probs, 20, 1e-6, mx.float32)
        equal = bool(mx.array_equal(got, want).item())
        max_diff = float(mx.abs(got - want).max().item())
        vs_reduction = float(mx.abs(got - sinkhorn_kernels.mixing_reference(probs, 20, 1e-6, mx.float32)).max().item())
    except Exception as error:  # noqa: BLE001 - reported, and the run goes on without the kernel
        _kernel_ok["ok"] = False
        return {"supported": True, "error": repr(error)[:2000]}
    _kernel_ok["ok"] = equal
    return {"supported": True, "bit_equal_to_ordered_reference": equal, "max_abs_diff": max_diff,
            "max_abs_diff_vs_reduction_reference": vs_reduction, "kernel_used": equal}


def _round(model: DeepseekV4, cache, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    for _ in range(2):  # warm-up: the first compiled call traces
        ids, _ = _decode_step(model, [cache], ids, ForwardTrace(stage_sync=False))
    times = []
    for _ in range(steps):
        ids, seconds = _decode_step(model, [cache], ids, ForwardTrace(stage_sync=False))
        times.append(seconds * 1000)
    return ids, times


def _summary(model: DeepseekV4, name: str, cache, rounds, emit) -> None:
    weights = weights_bytes_touched(model, 1)
    cache_bytes = cache_bytes_read(model.cfg, cache.num_tokens, model.dtype.size)
    bandwidth = copy_bandwidth(max(weights + cache_bytes, 2**26))
    floor_ms = (weights + cache_bytes) / bandwidth * 1000
    for arm in ARMS:
        steps = [s for a, round_steps in rounds if a == arm for s in round_steps]
        median = statistics.median(steps)
        emit("decode_summary", model=name, arm=arm, kernel_used=ARMS[arm][1] and _kernel_ok["ok"], ctx=cache.num_tokens, step_ms_median=median, step_ms_p90=_p90(steps),
             decode_tokens_per_s=1000 / median, bytes_read_per_step=weights + cache_bytes, weights_bytes_per_step=weights,
             cache_bytes_per_step=cache_bytes, copy_bandwidth_bytes_per_s=bandwidth, floor_ms=floor_ms, vs_floor=median / floor_ms)


def _node_count(arrays) -> int:
    path = "/tmp/issue14-decode-step.dot"
    mx.export_to_dot(path, *arrays)
    return Path(path).read_text().count("shape=rectangle")


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]  # nearest rank, as bench_decode


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir")
    p.add_argument("out", help="JSON lines output path")
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--steps", type=int, default=16, help="timed steps per round (rounds: on off off on)")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--no-quantized", action="store_true", help="only the bf16-dequantized model")
    p.add_argument("--cache-fill", choices=["prefill", "random"], default="prefill",
                   help="prefill: run a random prompt (default); random: caches of a prefill's shapes filled with "
                        "random rows in seconds (engine/tools/cache_fill.py), if the prefill does not fit the budget")
    return p.parse_args()


if __name__ == "__main__":
    main()
