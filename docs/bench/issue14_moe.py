"""Issue 14, part 5: the routed-expert layouts of engine/model/moe.py against a plain bf16 matmul, in one
process (docs/BENCHMARKS.md "Issue 14: MoE in prefill"). No checkpoint: one full-width MoE layer's
weights are drawn with mx.random (bf16) and quantized with mx.quantize(mode="mxfp4").

    python docs/bench/issue14_moe.py OUT.jsonl                  # GPU: V4 Flash widths, 4,096 rows
    python docs/bench/issue14_moe.py OUT.jsonl --size small     # CPU smoke test, same code path

Every timed iteration is `mx.eval(out); mx.synchronize()` after warm-ups; a setting's figure is the
median of its iterations over two rounds run in A B ... B A order. TFLOP/s counts the useful work
only: 3 gemms of 2·D·I FLOP per (token, expert) pair plus the shared expert's per token. The matmul
reference runs the same FLOP as dense gemms of the same shapes ([P + T, D] @ [D, I] twice,
[P + T, I] @ [I, D] once) and one [P, D] @ [D, I] gemm (full size: [24,576 × 4,096] @ [4,096 × 2,048]);
`fraction_of_matmul` divides by the faster of the two. "_one_block" settings switch the padded
layout's overflow block off (one capacity for all experts), to show what the overflow block buys;
"mxfp4_padded_dequantize32" dequantizes 32 experts at a time to bf16 inside the step and runs plain
batched gemms (moe.DEQUANTIZE_EXPERT_GROUP), instead of gather_qmm on the packed weights.
Optional parts (the row sweep, moe() as served) are skipped once --budget-s has passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from tessera.engine.model import moe as moe_mod
from tessera.engine.model.moe import MoEWeights, moe, routed_experts, swiglu
from tessera.engine.model.quantized import QuantizedWeight, quantize

LIMIT, SCALING = 10.0, 1.5


@dataclass(frozen=True)
class Size:
    experts: int
    top_k: int
    dim: int
    inter: int
    rows: int
    sweep: tuple[int, ...]  # row counts for the gathered-vs-padded crossover


SIZES = {
    "full": Size(256, 6, 4096, 2048, 4096, (64, 256, 1024)),  # V4 Flash: hidden 4096, moe 2048, 256 experts top-6
    "small": Size(16, 4, 256, 128, 512, (16, 64)),
}


def emit(out, **row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    out.write(line + "\n")
    out.flush()


def make_weights(s: Size, dtype: mx.Dtype) -> tuple[MoEWeights, MoEWeights]:
    """(plain, mxfp4 experts) for one MoE layer; the shared expert is plain in both."""
    def draw(shape):
        w = (mx.random.normal(shape, dtype=dtype) * 0.02).astype(dtype)
        mx.eval(w)
        return w
    w1, w2, w3 = draw((s.experts, s.inter, s.dim)), draw((s.experts, s.dim, s.inter)), draw((s.experts, s.inter, s.dim))
    plain = MoEWeights(
        router=draw((s.experts, s.dim)), correction_bias=mx.zeros((s.experts,)), tid2eid=None, w1=w1, w2=w2, w3=w3,
        shared_w1=draw((s.inter, s.dim)), shared_w2=draw((s.dim, s.inter)), shared_w3=draw((s.inter, s.dim)),
    )
    q = {name: quantize(getattr(plain, name), "mxfp4", 32) for name in ("w1", "w2", "w3")}
    mx.eval([a for v in q.values() for a in v.arrays()])
    return plain, replace(plain, **q)


def routing(s: Size, rows: int, kind: str, seed: int) -> tuple[mx.array, mx.array]:
    """(experts [T, k] int32 distinct per token, weights [T, k] float32). "random": uniform; "skewed":
    the first 20 % of experts drawn with 4× the weight of the rest (Gumbel top-k), ~half the pairs."""
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    logits = mx.zeros((s.experts,))
    if kind == "skewed":
        hot = max(1, s.experts // 5)
        logits = mx.where(mx.arange(s.experts) < hot, mx.log(mx.array(4.0)), 0.0)
    gumbel = -mx.log(-mx.log(mx.random.uniform(shape=(rows, s.experts), key=k1) + 1e-20) + 1e-20)
    experts = mx.argpartition(-(logits + gumbel), kth=s.top_k - 1, axis=-1)[:, : s.top_k].astype(mx.int32)
    weights = mx.random.uniform(shape=(rows, s.top_k), key=k2) + 0.1
    weights = weights / weights.sum(axis=-1, keepdims=True) * SCALING
    mx.eval(experts, weights)
    return experts, weights


def plan_summary(s: Size, experts: mx.array, w: MoEWeights) -> dict:
    """The padded layout's plan for this routing: rows computed vs pairs (the padding overhead)."""
    counts = np.array(moe_mod.expert_counts(experts.reshape(-1), s.experts))
    plan = moe_mod.plan_padded(counts, moe_mod.overflow_cost(w), moe_mod.PADDED_MAX_ROWS_PER_PAIR * experts.size)
    if plan is None:
        return {"plan": None, "pairs": experts.size}
    return {"capacity": plan.capacity, "overflow_experts": len(plan.overflow), "overflow_capacity": plan.overflow_capacity,
            "rows_computed": plan.rows(s.experts), "pairs": experts.size, "one_block_rows": moe_mod.plan_padded(counts, None).rows(s.experts)}


def routing_stats(s: Size, experts: mx.array) -> dict:
    counts = mx.zeros((s.experts,), dtype=mx.int32).at[experts.reshape(-1)].add(1)
    top = mx.sort(counts)[::-1]
    hot = max(1, s.experts // 5)
    return {"max_count": int(counts.max().item()), "mean_count": experts.size / s.experts,
            "top20pct_share": float(top[:hot].sum().item()) / experts.size, "empty_experts": int((counts == 0).sum().item())}


def block(x, experts, weights, w: MoEWeights, layout: str | None) -> mx.array:
    """The MoE block after routing: routed experts (in `layout`) + shared expert, as moe() sums them.
    The padded layout's fallback bound is off here: the setting names the layout that runs."""
    saved = moe_mod.PADDED_MAX_ROWS_PER_PAIR
    moe_mod.PADDED_MAX_ROWS_PER_PAIR = float("inf")
    try:
        routed = routed_experts(x, experts, weights, w, LIMIT, layout=layout)
    finally:
        moe_mod.PADDED_MAX_ROWS_PER_PAIR = saved
    return routed.astype(x.dtype) + swiglu(x, w.shared_w1, w.shared_w2, w.shared_w3, LIMIT)


def dequantized_groups_call(fn: Callable[[], mx.array], group: int) -> Callable[[], mx.array]:
    """The padded layout with mxfp4 experts dequantized `group` at a time (moe.DEQUANTIZE_EXPERT_GROUP)."""
    def run() -> mx.array:
        saved = moe_mod.DEQUANTIZE_EXPERT_GROUP
        moe_mod.DEQUANTIZE_EXPERT_GROUP = group
        try:
            out = fn()
            mx.eval(out)
        finally:
            moe_mod.DEQUANTIZE_EXPERT_GROUP = saved
        return out
    return run


@contextlib.contextmanager
def one_block() -> Iterator[None]:
    """The padded layout without its overflow block: every expert's block sized by the busiest one."""
    saved = dict(moe_mod.OVERFLOW_COST)
    moe_mod.OVERFLOW_COST.update({k: None for k in saved})
    try:
        yield
    finally:
        moe_mod.OVERFLOW_COST.update(saved)


def one_block_call(fn: Callable[[], mx.array]) -> Callable[[], mx.array]:
    def run() -> mx.array:
        with one_block():
            out = fn()
            mx.eval(out)  # inside: the graph is built (and its plan made) with the overflow block off
        return out
    return run


def time_it(fn: Callable[[], mx.array], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        mx.eval(fn())
        mx.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return times


def median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def dense_reference(s: Size, rows: int, dtype) -> tuple[Callable[[], mx.array], float, Callable[[], mx.array], float]:
    """(the MoE's FLOP as dense gemms of its shapes, its FLOP, one [24576 x D] @ [D x I] gemm, its FLOP)."""
    total = rows * s.top_k + rows
    a = mx.random.normal((total, s.dim), dtype=dtype)
    h = mx.random.normal((total, s.inter), dtype=dtype)
    b1, b3 = mx.random.normal((s.dim, s.inter), dtype=dtype), mx.random.normal((s.dim, s.inter), dtype=dtype)
    b2 = mx.random.normal((s.inter, s.dim), dtype=dtype)
    big = mx.random.normal((rows * s.top_k, s.dim), dtype=dtype)
    mx.eval(a, h, b1, b2, b3, big)
    shaped = lambda: [a @ b1, a @ b3, h @ b2]  # noqa: E731 - all three evaluated together
    one = lambda: big @ b1  # noqa: E731
    return shaped, 3 * 2 * total * s.dim * s.inter, one, 2 * rows * s.top_k * s.dim * s.inter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="JSON lines output path")
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per setting per round (>= 10 on the GPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--budget-s", type=float, default=120.0, help="skip the optional parts after this many seconds")
    args = p.parse_args()
    s = SIZES[args.size]
    on_gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if on_gpu else "float32"))
    t0 = time.perf_counter()
    with open(args.out, "w") as out:
        emit(out, what="setup", size=args.size, device=str(mx.default_device()), dtype=str(dtype), mlx=mx.__version__, **s.__dict__)
        plain, fp4 = make_weights(s, dtype)
        mx.random.seed(0)
        x = mx.random.normal((s.rows, s.dim), dtype=dtype)
        shaped, shaped_flop, one, one_flop = dense_reference(s, s.rows, dtype)
        flop = 3 * 2 * s.dim * s.inter * (s.rows * s.top_k + s.rows)
        emit(out, what="weights_ready", seconds=time.perf_counter() - t0)
        for kind in ("random", "skewed"):
            experts, weights = routing(s, s.rows, kind, seed=1)
            emit(out, what="routing", routing=kind, rows=s.rows, **routing_stats(s, experts))
            settings = {  # the old gathered layout last in the first round (an H200 run once crashed in it)
                "matmul_moe_shapes": (shaped, shaped_flop),
                "matmul_one_gemm": (one, one_flop),
                "bf16_padded": (lambda: block(x, experts, weights, plain, "padded"), flop),
                "bf16_padded_one_block": (one_block_call(lambda: block(x, experts, weights, plain, "padded")), flop),
                "mxfp4_padded": (lambda: block(x, experts, weights, fp4, "padded"), flop),
                "mxfp4_padded_one_block": (one_block_call(lambda: block(x, experts, weights, fp4, "padded")), flop),
                "mxfp4_padded_dequantize32": (dequantized_groups_call(lambda: block(x, experts, weights, fp4, "padded"), 32), flop),
                "bf16_gathered": (lambda: block(x, experts, weights, plain, "gathered"), flop),
                "mxfp4_gathered": (lambda: block(x, experts, weights, fp4, "gathered"), flop),
            }
            order = list(settings) + list(settings)[::-1]  # A B ... B A
            times: dict[str, list[list[float]]] = {name: [] for name in settings}
            for name in order:
                times[name].append(time_it(settings[name][0], args.iters, args.warmup))
                emit(out, what="moe_round", routing=kind, setting=name, round=len(times[name]),
                     ms_median=1e3 * median(times[name][-1]), tflops=settings[name][1] / median(times[name][-1]) / 1e12)
            rates = {n: settings[n][1] / median(sum(t, [])) / 1e12 for n, t in times.items()}
            ref = max(rates["matmul_moe_shapes"], rates["matmul_one_gemm"])
            for name, rounds in times.items():
                emit(out, what="moe_layout", routing=kind, setting=name, rows=s.rows, ms_median=1e3 * median(sum(rounds, [])),
                     ms_round_medians=[1e3 * median(r) for r in rounds], tflops=rates[name],
                     fraction_of_matmul=rates[name] / ref, matmul_ref_tflops=ref)
            emit(out, what="padded_plan", routing=kind, **plan_summary(s, experts, plain), elapsed_s=time.perf_counter() - t0)
        for part in (lambda: full_block(out, s, plain, x, args), lambda: sweep(out, s, plain, fp4, dtype, args)):
            if time.perf_counter() - t0 > args.budget_s:
                emit(out, what="skipped_optional_part", elapsed_s=time.perf_counter() - t0)
                continue
            part()
        emit(out, what="done", seconds=time.perf_counter() - t0)


def sweep(out, s: Size, plain: MoEWeights, fp4: MoEWeights, dtype, args) -> None:
    """Gathered vs padded at fewer rows (random routing): where the padded layout starts to pay."""
    for rows in s.sweep:
        xs = mx.random.normal((rows, s.dim), dtype=dtype)
        experts, weights = routing(s, rows, "random", seed=2)
        flop = 3 * 2 * s.dim * s.inter * (rows * s.top_k + rows)
        fns = {f"{name}_{layout}": (lambda w=w, layout=layout: block(xs, experts, weights, w, layout))
               for name, w in (("bf16", plain), ("mxfp4", fp4)) for layout in ("gathered", "padded")}
        order = list(fns) + list(fns)[::-1]
        times: dict[str, list[float]] = {n: [] for n in fns}
        for name in order:
            times[name] += time_it(fns[name], max(3, args.iters // 2), 1)
        for name, t in times.items():
            emit(out, what="moe_sweep", rows=rows, pairs_per_expert=rows * s.top_k / s.experts, setting=name,
                 ms_median=1e3 * median(t), tflops=flop / median(t) / 1e12)


def full_block(out, s: Size, plain: MoEWeights, x: mx.array, args) -> None:
    """moe() as the model calls it (router included, layout picked by row count), learned routing with
    a random router."""
    ids = mx.zeros((s.rows,), dtype=mx.int32)
    t = time_it(lambda: moe(x, ids, plain, s.top_k, SCALING, LIMIT), args.iters, args.warmup)
    flop = 3 * 2 * s.dim * s.inter * (s.rows * s.top_k + s.rows)
    emit(out, what="moe_block_as_served", rows=s.rows, ms_median=1e3 * median(t), tflops=flop / median(t) / 1e12)


if __name__ == "__main__":
    main()
