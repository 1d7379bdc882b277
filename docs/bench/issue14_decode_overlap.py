"""Decode with the next step overlapped (docs/BENCHMARKS.md "Issue 14, session 10"), in one process:
B sequences at CTX (random cache rows), then rounds of four arms at batch 1 and batch B, in the order
A B C D D C B A (--rounds times; --arms picks a subset). Every arm takes greedy tokens:

- serial: `model.forward`; build step n, evaluate it, read its tokens to the host, then build step n + 1;
- overlap: `model.forward`; step n + 1 is built from step n's sampled tokens while they are still on the
  device (`forward(..., device_token_ids=...)`) and queued (`mx.async_eval`) before step n's tokens are
  read, so Python's graph building of one step runs while the device runs the other;
- serving: `ModelRunner.execute` of decode plans (the server's step, sampler included), decode overlap off;
- serving_overlap: the same with the decode overlap on (engine/serving/decode_overlap.py), what a server runs;
- serial_thread, serving_thread, serving_overlap_thread: those arms with each decode layer handed to the
  encode thread as soon as it is built (TESSERA_DECODE_ASYNC=thread, engine/model/encode_thread.py);
- serving_overlap_compiled, serving_overlap_plain: serving_overlap with the step's shape-stable parts compiled
  or not (TESSERA_COMPILE_STEP; unset, on with a GPU since session 12, so serving_overlap there is compiled);
- serving_overlap_qmm: serving_overlap with kernels/gather_qmv.py's mxfp4 gemv off for the arm (MLX's
  gather_qmm instead; as-loaded checkpoints, where the kernel applies). Session 11 ran this script when the
  kernel was off by default, with an arm "serving_overlap_qmv" that turned it on: the raw files'
  serving_overlap is the kernel off there, serving_overlap_qmv on;
- serving_overlap_unstacked: serving_overlap with a layer's input projections one matmul each
  (TESSERA_STACKED_INPUTS=0); serving_overlap_dense8: with TESSERA_DENSE_MIN_ROWS=8 (decode batches of 8 or
  more sequences run the attention and shared-expert projections on per-step dequantized copies; on the H200
  the op bench had them slower than the quantized GEMM at 16 rows, docs/BENCHMARKS.md "Session 14").
- serving_overlap_batch_gather, serving_overlap_no_batch_gather: serving_overlap with TESSERA_DECODE_BATCH_GATHER
  1 or 0 (a decode batch's CSA selected rows and HCA rows in one launch each, kernels/row_gather.py, or a gather
  or copy per sequence; 1 is the default since session 16, 0 before);
- serving_overlap_no_mxfp8_qmv: serving_overlap with kernels/mxfp8_qmv.py off (MLX's quantized matmul for a batch's
  mxfp8 projections; TESSERA_MXFP8_QMV_KERNEL=0).
- serving_overlap_sinkhorn_thread: serving_overlap with the hyper-connections' Sinkhorn kernel a thread per token
  (TESSERA_SINKHORN_WARP=0, kernels/sinkhorn.py; the default is a lane per matrix entry. Sessions 17 and 18's runs
  at dd2ba84 and 22c7227 had the opposite default and an arm serving_overlap_sinkhorn_warp).
- serving_overlap_no_hc_mix: serving_overlap with the hyper-connections' mixing logits through MLX (cast, norm,
  gemv, scale and bias) instead of their one kernel (TESSERA_HC_MIX_KERNEL=0, kernels/hc_mix.py).
- serving_overlap_no_hc_collapse: serving_overlap with what follows those logits (coefficients, softmax, Sinkhorn,
  weighted sum, the block's norm) through MLX instead of one kernel a collapse (TESSERA_HC_COLLAPSE_KERNEL=0,
  kernels/hc_collapse.py).
- serving_overlap_no_hc_expand: serving_overlap with the hyper-connections' expand (and, after the MoE, its sums)
  through MLX instead of one kernel each (TESSERA_HC_EXPAND_KERNEL=0, kernels/hc_expand.py).
- serving_overlap_no_moe_route: serving_overlap with the MoE router's work after its product (scores, top-k,
  weights) through MLX instead of one kernel (TESSERA_MOE_ROUTE_KERNEL=0, kernels/moe_route.py).
- serving_overlap_no_decode_attention: serving_overlap with the decode rows' mixed attention through MLX (cuBLAS
  products, masks, softmax, casts) instead of its one kernel (TESSERA_DECODE_ATTENTION_KERNEL=0,
  kernels/decode_attention_cuda.py).
- serving_overlap_rms_norm, serving_overlap_no_rms_norm: serving_overlap with bf16 RMS norms in one kernel each, or
  through MLX's cast, norm and cast back (TESSERA_RMS_NORM_KERNEL=1 / 0, kernels/rms_norm_cuda.py; on by default
  since session 37, so serving_overlap_rms_norm is serving_overlap since then).
- serving_overlap_mma, serving_overlap_table: serving_overlap with the routed experts' bf16 rows through
  kernels/gather_qmv.py's tensor-core variant or its 16-entry-table kernel (TESSERA_GATHER_QMV_MMA=1 / 0).
  Session 29's raw files also hold serving_overlap_grouped and serving_overlap_ungrouped (a grouped expert kernel,
  commit 88072f8), serving_overlap_byte_table and serving_overlap_lut (a byte-table decode of the experts' codes,
  commit 052ec31), both measured and removed; their "ungrouped" and "lut" arms are serving_overlap.
  Session 14's raw file also holds serving_overlap_qmv_bits and serving_overlap_qmv_prefetch, gather_qmv
  layouts since removed; session 18's serving_overlap_no_host_array_cache, a cache removed after it measured
  nothing (docs/ARCHITECTURE.md "Host-made arrays").

A step's time is the interval between two tokens reaching the host. One JSON line per round to OUT: the median
step and its tokens/s, and the mean step and its (sustained) tokens/s: every fourth step closes CSA windows and is
slower (docs/BENCHMARKS.md, "Session 27"); the summary gives the batched ratio from both.
--profile-steps N: afterwards, each arm at each batch size under cProfile, one "profile" line each: where
the host's time of a step goes, per function (ms a step, the arm's setup taken out: `host_profile`). MLX's
nanobind calls are not Python functions to cProfile: their time is their caller's own, so MLX's encoding
shows as the own time of the function calling `mx.async_eval`, waiting for the device as that of the one
reading the tokens. cProfile slows Python calls: read the shares and the batch 1 / batch B differences, not
the step times.

H200:
  python docs/bench/issue14_decode_overlap.py /dev/shm/fw OUT.jsonl --ctx 16384 --batch 16 [--as-loaded]
CPU (small sizes):
  python docs/bench/issue14_decode_overlap.py /tmp/small OUT.jsonl --ctx 2048 --batch 8 --chunk 1024
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.probe_io import jsonl_emitter, load_probe_model  # noqa: E402
from tessera.engine.model import attention, compiled, decode_async, quantized  # noqa: E402
from tessera.engine.model.deepseek_v4 import PENDING_TOKEN, Segment  # noqa: E402
from tessera.kernels import decode_attention_cuda, gather_qmv, hc_collapse, hc_expand, hc_mix, moe_route, mxfp8_qmv, rms_norm_cuda, row_gather, sinkhorn  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled, serving_step_seconds  # noqa: E402


def serial_steps(model, caches, steps: int) -> tuple[list[float], list[int]]:
    """Milliseconds per step and the last tokens, each step's tokens on the host before the next is built."""
    ids, out = [1] * len(caches), []
    last = time.perf_counter()
    for _ in range(steps):
        logits = model.forward([Segment(c, [t]) for c, t in zip(caches, ids)])
        ids = mx.argmax(mx.concatenate(logits), axis=-1).tolist()
        now = time.perf_counter()
        out.append((now - last) * 1000)
        last = now
    return out, ids


def overlapped_steps(model, caches, steps: int) -> tuple[list[float], list[int]]:
    """The same steps, step n + 1 queued on step n's device tokens before those are read."""
    def launch(tokens: mx.array) -> mx.array:
        logits = model.forward([Segment(c, [PENDING_TOKEN]) for c in caches], device_token_ids=tokens)
        sampled = mx.argmax(mx.concatenate(logits), axis=-1).astype(mx.int32)  # [B]
        mx.async_eval(sampled)
        return sampled

    in_flight = launch(mx.array([1] * len(caches), dtype=mx.int32))
    out, ids = [], []
    last = time.perf_counter()
    for _ in range(steps):
        following = launch(in_flight)
        ids = in_flight.tolist()
        now = time.perf_counter()
        out.append((now - last) * 1000)
        last = now
        in_flight = following
    ids = in_flight.tolist()  # the step queued last: its rows are in the caches already
    return out, ids


def serving_steps(overlap: bool):
    def steps_of(model, caches, steps: int) -> tuple[list[float], None]:
        options = DecodeOptions(chunk=4096, tile=1024, decode_overlap=overlap)
        seconds, _ = serving_step_seconds(model, caches, [1] * len(caches), steps + 1, options)
        return [s * 1000 for s in seconds[1:]], None  # the first interval includes the first step's build

    return steps_of


def with_setting(get, put, value, arm):
    """`arm` with a switch (read by `get`, set by `put`) at `value` for the arm, restored after it."""
    def steps_of(model, caches, steps: int):
        saved = get()
        put(value)
        try:
            return arm(model, caches, steps)
        finally:
            put(saved)

    return steps_of


def without_gather_qmv(arm):
    return with_setting(gather_qmv.kernel_enabled, gather_qmv.set_kernel_enabled, False, arm)


def with_decode_async(mode: str, arm):
    """The decode steps' layers reaching the device as `mode` says (engine/model/decode_async.py)."""
    return with_setting(decode_async.decode_async_mode, decode_async.set_decode_async_mode, mode, arm)


def with_step_compile(enabled: bool, arm):
    """The decode step's shape-stable parts compiled or not (TESSERA_COMPILE_STEP, engine/model/compiled.py)."""
    return with_setting(compiled.step_compile_enabled, compiled.set_step_compile_enabled, enabled, arm)


ARMS = {"serial": serial_steps, "overlap": overlapped_steps, "serving": serving_steps(False),
        "serving_overlap": serving_steps(True), "serving_overlap_qmm": without_gather_qmv(serving_steps(True)),
        "serial_thread": with_decode_async("thread", serial_steps),
        "serving_thread": with_decode_async("thread", serving_steps(False)),
        "serving_overlap_thread": with_decode_async("thread", serving_steps(True)),
        "serving_overlap_compiled": with_step_compile(True, serving_steps(True)),
        "serving_overlap_plain": with_step_compile(False, serving_steps(True))}
ARMS["serving_overlap_dense8"] = with_setting(quantized.dense_min_rows, quantized.set_dense_min_rows, 8,
                                              ARMS["serving_overlap"])  # TESSERA_DENSE_MIN_ROWS=8
ARMS["serving_overlap_unstacked"] = with_setting(attention.stacked_inputs_enabled, attention.set_stacked_inputs_enabled, False,
                                                 ARMS["serving_overlap"])
ARMS["serving_overlap_batch_gather"] = with_setting(row_gather.batch_gather_enabled, row_gather.set_batch_gather_enabled, True,
                                                    ARMS["serving_overlap"])  # TESSERA_DECODE_BATCH_GATHER=1
ARMS["serving_overlap_no_batch_gather"] = with_setting(row_gather.batch_gather_enabled, row_gather.set_batch_gather_enabled,
                                                       False, ARMS["serving_overlap"])  # TESSERA_DECODE_BATCH_GATHER=0
# serving_overlap with one kernel's switch (`kernel_enabled` / `set_kernel_enabled` of its module) at a value:
# arm -> (module, value); the environment variable each stands for in the module docstring above.
KERNEL_ARMS = {
    "serving_overlap_no_mxfp8_qmv": (mxfp8_qmv, False),  # TESSERA_MXFP8_QMV_KERNEL=0
    "serving_overlap_no_hc_mix": (hc_mix, False),  # TESSERA_HC_MIX_KERNEL=0
    "serving_overlap_no_hc_collapse": (hc_collapse, False),  # TESSERA_HC_COLLAPSE_KERNEL=0
    "serving_overlap_no_hc_expand": (hc_expand, False),  # TESSERA_HC_EXPAND_KERNEL=0
    "serving_overlap_no_moe_route": (moe_route, False),  # TESSERA_MOE_ROUTE_KERNEL=0
    "serving_overlap_no_decode_attention": (decode_attention_cuda, False),  # TESSERA_DECODE_ATTENTION_KERNEL=0
    "serving_overlap_rms_norm": (rms_norm_cuda, True),  # TESSERA_RMS_NORM_KERNEL=1
    "serving_overlap_no_rms_norm": (rms_norm_cuda, False),  # TESSERA_RMS_NORM_KERNEL=0
}
for _name, (_module, _value) in KERNEL_ARMS.items():
    ARMS[_name] = with_setting(_module.kernel_enabled, _module.set_kernel_enabled, _value, ARMS["serving_overlap"])
ARMS["serving_overlap_sinkhorn_thread"] = with_setting(sinkhorn.warp_enabled, sinkhorn.set_warp_enabled, False,
                                                       ARMS["serving_overlap"])  # TESSERA_SINKHORN_WARP=0
ARMS["serving_overlap_mma"] = with_setting(gather_qmv.mma_enabled, gather_qmv.set_mma_enabled, True,
                                           ARMS["serving_overlap"])  # TESSERA_GATHER_QMV_MMA=1
ARMS["serving_overlap_table"] = with_setting(gather_qmv.mma_enabled, gather_qmv.set_mma_enabled, False,
                                             ARMS["serving_overlap"])  # TESSERA_GATHER_QMV_MMA=0


def main() -> None:
    args = _parser().parse_args()
    emit = jsonl_emitter(args.out)
    t0 = time.perf_counter()
    model = load_probe_model(args.model, args.as_loaded)
    emit("loaded", seconds=round(time.perf_counter() - t0, 2), dtype=str(model.dtype), as_loaded=args.as_loaded)
    options = DecodeOptions(chunk=args.chunk, tile=args.tile, cache_fill="random")
    caches = [_filled(model, args.ctx, b, options) for b in range(args.batch)]
    emit("filled", seconds=round(time.perf_counter() - t0, 2), ctx=args.ctx, batch=args.batch)
    medians: dict[tuple[str, int], list[float]] = {}
    means: dict[tuple[str, int], list[float]] = {}
    for batch in (1, args.batch):
        for arm in args.arms:  # warm every arm at this batch size
            ARMS[arm](model, caches[:batch], 3)
        for arm in (args.arms + args.arms[::-1]) * args.rounds:
            steps, _ = ARMS[arm](model, caches[:batch], args.steps)
            median = statistics.median(steps[1:])  # the first interval includes the first step's build
            mean = statistics.fmean(steps[1:])  # every fourth step closes CSA windows and is slower
            medians.setdefault((arm, batch), []).append(median)
            means.setdefault((arm, batch), []).append(mean)
            emit("decode", arm=arm, ctx=args.ctx, batch=batch, step_ms_median=median, step_ms_mean=mean,
                 tokens_per_s=batch / median * 1000, sustained_tokens_per_s=batch / mean * 1000, step_ms=steps)
    for batch in (1, args.batch) if args.profile_steps else ():
        for arm in args.arms:
            emit("profile", arm=arm, ctx=args.ctx, batch=batch, steps=args.profile_steps,
                 **host_profile(ARMS[arm], model, caches[:batch], args.profile_steps, top=args.profile_top,
                                  top_total=args.profile_top_total))
    summary = {f"{arm}_b{batch}_step_ms": statistics.median(v) for (arm, batch), v in medians.items()}
    for arm in args.arms:  # the batch's tokens/s over one sequence's, from the rounds' median and mean steps
        for name, per_round in (("ratio", medians), ("sustained_ratio", means)):
            one, many = (statistics.median(per_round[(arm, b)]) for b in (1, args.batch))
            summary[f"{arm}_{name}_b{args.batch}_over_b1"] = args.batch * one / many
    emit("summary", ctx=args.ctx, batch=args.batch, as_loaded=args.as_loaded, **summary,
         seconds=round(time.perf_counter() - t0, 2))


SETUP_STEPS = 1  # the profile's short run: the arm's setup (a runner and its requests) and this many steps
MODEL_STEP = ("deepseek_v4.py", "forward")  # always listed: a ranking by total time can miss it (see host_profile)


def host_profile(arm, model, caches, steps: int, top: int = 60, top_total: int = 20) -> dict:
    """`arm` under cProfile -> the `top` functions with the most time of their own and the `top_total` with the
    most in total, and the model's step (MODEL_STEP) whatever its rank, by own time: ms a step
    ("self"; "total" with what they call), how often each ran a step, and the three callers that spent the
    most time in it.
    The arm's setup is taken out: it runs once for SETUP_STEPS steps and once for SETUP_STEPS + `steps`, and
    each function's numbers are the difference, per step (noisy functions can come out slightly negative).
    The model's step is picked by name: with the overlap its total is only the graph it builds, and on a
    busy machine more than `top_total` callers and waits can outrank it (CI once listed it nowhere)."""
    short = _profiled(arm, model, caches, SETUP_STEPS)
    long = _profiled(arm, model, caches, SETUP_STEPS + steps)
    per_step = {}
    for key, (_, calls, own, total, callers) in long.items():
        _, short_calls, short_own, short_total, _ = short.get(key, (0, 0, 0.0, 0.0, {}))
        per_step[key] = ((calls - short_calls) / steps, (own - short_own) / steps, (total - short_total) / steps, callers)
    by_total = sorted(per_step, key=lambda key: -per_step[key][2])[:top_total]
    model_step = {key for key in per_step if (Path(key[0]).name, key[2]) == MODEL_STEP}
    picked = set(sorted(per_step, key=lambda key: -per_step[key][1])[:top]) | set(by_total) | model_step
    rows = sorted(((key, per_step[key]) for key in picked), key=lambda item: -item[1][1])
    return {"functions": [
        {"where": f"{Path(file).name}:{line}({name})", "self_ms": round(own * 1e3, 4), "total_ms": round(total * 1e3, 4),
         "calls": round(calls, 2), "callers": _top_callers(callers)}
        for (file, line, name), (calls, own, total, callers) in rows]}


def _profiled(arm, model, caches, steps: int) -> dict:
    """pstats' table of `arm` run for `steps` steps: (file, line, name) -> (primitive calls, calls, self s,
    total s, callers)."""
    profiler = cProfile.Profile()
    profiler.enable()
    arm(model, caches, steps)
    profiler.disable()
    return pstats.Stats(profiler).stats


def _top_callers(callers: dict, top: int = 3) -> list[str]:
    """pstats' callers of one function ((file, line, name) -> (…, self s, total s)) -> the `top` by time spent."""
    ranked = sorted(callers.items(), key=lambda item: -item[1][3])[:top]
    return [f"{Path(file).name}:{line}({name})" for (file, line, name), _ in ranked]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out", help="JSON lines, one per round")
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=16, help="timed steps per round")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["serial", "overlap", "serving", "serving_overlap"], help="the arms to run, in this order")
    p.add_argument("--rounds", type=int, default=2, help="A B .. B A sequences per batch size")
    p.add_argument("--profile-top", type=int, default=60,
                   help="the profile lists this many functions by own time")
    p.add_argument("--profile-top-total", type=int, default=20,
                   help="and this many by total time (the model's step is listed whatever its rank)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then each arm and batch size this many steps under cProfile (0: none)")
    p.add_argument("--as-loaded", action="store_true",
                   help="keep a quantized checkpoint's weights as loaded (mxfp8/mxfp4), not dequantized to bf16")
    return p


if __name__ == "__main__":
    main()
