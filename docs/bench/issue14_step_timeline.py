"""Is a decode step host-bound or device-bound? Its host time split, and the device's own time for it.

python docs/bench/issue14_step_timeline.py MODEL OUT.jsonl [--ctx 65536] [--batch 1 [16 …]] [--steps 24] [--rounds 2]
    [--arms off thread compiled compiled_thread] [--as-loaded]

Arms, in the order A B … B A (--rounds times), each a mode of the same model-level greedy step:
- off: the step built whole, then evaluated; thread: each layer handed to the encode thread
  (TESSERA_DECODE_ASYNC=thread); compiled: TESSERA_COMPILE_STEP on; compiled_thread: both; compiled_unstacked:
  compiled with TESSERA_STACKED_INPUTS off (one matmul per input projection, docs/ARCHITECTURE.md);
  compiled_no_mxfp8_qmv: compiled with kernels/mxfp8_qmv.py off (TESSERA_MXFP8_QMV_KERNEL=0: MLX's quantized
  matmul for a batch's mxfp8 projections). The other arms have it on (the default). compiled_sinkhorn_thread:
  compiled with the hyper-connections' Sinkhorn kernel a thread per token (TESSERA_SINKHORN_WARP=0,
  kernels/sinkhorn.py); the other arms take the default, a lane per matrix entry (session 18's runs, at
  22c7227, named the warp layout's arm compiled_sinkhorn_warp: then the thread per token was the default). compiled_no_hc_mix: compiled with
  the hyper-connections' mixing logits through MLX (TESSERA_HC_MIX_KERNEL=0, kernels/hc_mix.py); the other arms
  take its kernel (the default). compiled_no_hc_collapse: compiled with what follows those logits (coefficients,
  softmax, Sinkhorn, weighted sum, the block's norm) through MLX (TESSERA_HC_COLLAPSE_KERNEL=0, kernels/hc_collapse.py);
  the other arms take its kernel. compiled_no_hc_expand: compiled with the expand (and the MoE's sums before the FFN
  half's) through MLX (TESSERA_HC_EXPAND_KERNEL=0, kernels/hc_expand.py); the other arms take its kernels.
  compiled_no_moe_route: compiled with the router's scores, top-k and weights through MLX
  (TESSERA_MOE_ROUTE_KERNEL=0, kernels/moe_route.py); the other arms take its kernel. compiled_no_decode_attention: compiled with the decode rows' mixed attention
  through MLX (TESSERA_DECODE_ATTENTION_KERNEL=0, kernels/decode_attention_cuda.py); the other arms take its kernel.
  compiled_rms_norm, compiled_no_rms_norm: compiled with bf16 RMS norms in one kernel each (TESSERA_RMS_NORM_KERNEL=1,
  kernels/rms_norm_cuda.py, the default since session 37) or through MLX's path (a cast, its norm, a cast back: =0).
  (Session 13's `compiled_qmv` arm, a batch's projections through MLX's gemv in blocks of ≤ 7 rows, ran at
  commit db10e55; the switch it flipped was removed after the H200 measured it slower.)

Per step, two timings:
1. The host's: `build_ms` (model.forward returned; in thread arms the drain included), `encode_ms`
   (`mx.async_eval` of the sampled ids returned: MLX encoded what was left), `wait_ms` (the ids on the host).
2. The device's alone (`device_ms`): the same step queued behind a spin kernel that holds the GPU for
   `--spin-ms`, so the host builds and encodes the whole step while the device is busy; the ids then arrive
   `spin + device` after the spin was queued. `device_ms` = that interval − the spin's own (measured alone:
   mlx_encode_cost.py's `spin_ms`; the session-12 run, before the two probes shared it, took the median of
   all five calls, the first included). Only meaningful on a GPU (the spin is a CUDA kernel); the CPU runs the host timings only.

With several `--batch` sizes, every round runs each of them in turn (the first sequences of one filled batch),
so their times come from the same process and the same minutes.

Also one line `kernel_chain`: K independent tiny elementwise kernels (no fusion) — the host's encode cost
per kernel and the device's time per kernel, measured the same way.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.mlx_encode_cost import spin, spin_ms  # noqa: E402
from docs.bench.probe_io import jsonl_emitter, load_probe_model  # noqa: E402
from tessera.engine.model import decode_async  # noqa: E402
from tessera.engine.model.attention import set_stacked_inputs_enabled, stacked_inputs_enabled  # noqa: E402
from tessera.engine.model.compiled import set_step_compile_enabled, step_compile_enabled  # noqa: E402
from tessera.engine.model.deepseek_v4 import Segment  # noqa: E402
from tessera.engine.model.encode_thread import encode_thread  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled  # noqa: E402
from tessera.kernels import decode_attention_cuda, hc_collapse, hc_expand, hc_mix, moe_route, mxfp8_qmv, rms_norm_cuda, sinkhorn  # noqa: E402


@dataclass(frozen=True)
class Arm:
    """An arm's settings: each field one switch (SWITCHES), the defaults the engine's own."""

    decode_async: str = "off"
    step_compile: bool = True
    stacked_inputs: bool = True
    mxfp8_qmv: bool = True
    sinkhorn_warp: bool = True
    hc_mix: bool = True
    hc_collapse: bool = True
    hc_expand: bool = True
    moe_route: bool = True
    decode_attention: bool = True
    rms_norm: bool = True


# switch -> (read it, set it)
SWITCHES = {"decode_async": (decode_async.decode_async_mode, decode_async.set_decode_async_mode),
            "step_compile": (step_compile_enabled, set_step_compile_enabled),
            "stacked_inputs": (stacked_inputs_enabled, set_stacked_inputs_enabled),
            "mxfp8_qmv": (mxfp8_qmv.kernel_enabled, mxfp8_qmv.set_kernel_enabled),
            "sinkhorn_warp": (sinkhorn.warp_enabled, sinkhorn.set_warp_enabled),
            "hc_mix": (hc_mix.kernel_enabled, hc_mix.set_kernel_enabled),
            "hc_collapse": (hc_collapse.kernel_enabled, hc_collapse.set_kernel_enabled),
            "hc_expand": (hc_expand.kernel_enabled, hc_expand.set_kernel_enabled),
            "moe_route": (moe_route.kernel_enabled, moe_route.set_kernel_enabled),
            "decode_attention": (decode_attention_cuda.kernel_enabled, decode_attention_cuda.set_kernel_enabled),
            "rms_norm": (rms_norm_cuda.kernel_enabled, rms_norm_cuda.set_kernel_enabled)}
assert set(SWITCHES) == {f.name for f in fields(Arm)}

ARMS = {"off": Arm(step_compile=False), "thread": Arm(decode_async="thread", step_compile=False),
        "compiled": Arm(), "compiled_thread": Arm(decode_async="thread"),
        "compiled_unstacked": Arm(stacked_inputs=False),
        "compiled_no_mxfp8_qmv": Arm(mxfp8_qmv=False),
        "compiled_sinkhorn_thread": Arm(sinkhorn_warp=False),
        "compiled_no_hc_mix": Arm(hc_mix=False),
        "compiled_no_hc_collapse": Arm(hc_collapse=False),
        "compiled_no_hc_expand": Arm(hc_expand=False),
        "compiled_no_moe_route": Arm(moe_route=False),
        "compiled_no_decode_attention": Arm(decode_attention=False),
        "compiled_rms_norm": Arm(rms_norm=True),
        "compiled_no_rms_norm": Arm(rms_norm=False)}


def step(model, caches, ids: list[int]) -> tuple[mx.array, float, float]:
    t0 = time.perf_counter()
    logits = model.forward([Segment(c, [t]) for c, t in zip(caches, ids)])
    t1 = time.perf_counter()
    sampled = mx.argmax(mx.concatenate(logits), axis=-1)
    mx.async_eval(sampled)
    t2 = time.perf_counter()
    return sampled, (t1 - t0) * 1000, (t2 - t1) * 1000


def host_steps(model, caches, steps: int) -> list[dict]:
    ids, rows = [1] * len(caches), []
    for _ in range(steps):
        sampled, build, encode = step(model, caches, ids)
        t2 = time.perf_counter()
        ids = sampled.tolist()
        rows.append({"build_ms": build, "encode_ms": encode, "wait_ms": (time.perf_counter() - t2) * 1000})
    return rows


def device_steps(model, caches, steps: int, cycles: float, spin_alone_ms: float) -> list[float]:
    # The spin goes on the stream the step's layers run on: the encode thread's in thread arms (the head and
    # the sampler, on this thread's stream, wait for the layers).
    threaded = decode_async.decode_async_mode() == "thread"
    stream = encode_thread(mx.default_device()).stream if threaded else mx.default_stream(mx.default_device())
    ids, out = [1] * len(caches), []
    for _ in range(steps):
        t0 = time.perf_counter()
        with mx.stream(stream):
            mx.async_eval(spin(cycles))  # the device is busy from here for spin_alone_ms
        sampled, _, _ = step(model, caches, ids)
        ids = sampled.tolist()
        out.append((time.perf_counter() - t0) * 1000 - spin_alone_ms)
    return out


def kernel_chain(emit, k: int, cycles: float, spin_alone_ms: float) -> None:
    x = mx.zeros((1, 4096), dtype=mx.bfloat16)
    mx.eval(x)
    for _ in range(3):
        outs = [x + float(i) for i in range(k)]  # independent: no fusion, k kernels
        t0 = time.perf_counter()
        mx.async_eval(outs)
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        mx.async_eval(spin(cycles))
        outs = [x + float(i) for i in range(k)]
        mx.eval(outs)
        t3 = time.perf_counter()
    emit("kernel_chain", kernels=k, encode_us_per_kernel=(t1 - t0) / k * 1e6, host_done_ms=(t2 - t0) * 1000,
         device_us_per_kernel=((t3 - t2) * 1000 - spin_alone_ms) / k * 1000)


def main() -> None:
    args = _parser().parse_args()
    emit = jsonl_emitter(args.out)
    on_gpu = mx.default_device() == mx.gpu
    cycles = args.spin_ms * 1.98e6  # the H200's SM clock, ~1.98 GHz; the spin is calibrated below anyway
    spin_alone = spin_ms(cycles) if on_gpu else 0.0
    emit("spin", requested_ms=args.spin_ms, measured_ms=spin_alone)
    if on_gpu:
        kernel_chain(emit, 500, cycles, spin_alone)
    model = load_probe_model(args.model, args.as_loaded)
    caches = [_filled(model, args.ctx, b, DecodeOptions(chunk=4096, tile=1024, cache_fill="random")) for b in range(max(args.batch))]
    saved = _switches()
    try:
        for arm in args.arms:  # warm every arm (a compiled arm's first step traces it)
            _set(arm)
            for batch in args.batch:
                t0 = time.perf_counter()
                host_steps(model, caches[:batch], 3)
                emit("warm", arm=arm, batch=batch, seconds=time.perf_counter() - t0)
        for arm in (args.arms + args.arms[::-1]) * args.rounds:
            _set(arm)
            for batch in args.batch:
                host = host_steps(model, caches[:batch], args.steps)
                device = device_steps(model, caches[:batch], args.steps, cycles, spin_alone) if on_gpu else []
                med = {k: statistics.median(r[k] for r in host) for k in ("build_ms", "encode_ms", "wait_ms")}
                emit("round", arm=arm, ctx=args.ctx, batch=batch, switches=_switches(), **med,
                     host_step_ms=statistics.median(sum(r.values()) for r in host),
                     device_ms=statistics.median(device) if device else None, steps=host, device_steps=device)
    finally:
        for name, value in saved.items():
            SWITCHES[name][1](value)


def _switches() -> dict[str, object]:
    """The settings a round ran with, read back from the switches themselves (what the arm set, not what it meant to)."""
    return {name: read() for name, (read, _) in SWITCHES.items()}


def _set(arm: str) -> None:
    for name, value in asdict(ARMS[arm]).items():
        SWITCHES[name][1](value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="sequences per step; several: each in every round")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spin-ms", type=float, default=40.0)
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--as-loaded", action="store_true")
    return p


if __name__ == "__main__":
    main()
