"""The decode rows' mixed attention alone, kernel against MLX's reference (kernels/decode_attention_cuda.py):
the host's time to encode a call and the device's time to run it, at V4 Flash's CSA shapes (64 heads of 512, a
128-row window and 512 selected rows a token), for each batch size, in the order A B B A.

python docs/bench/decode_attention_probe.py OUT.jsonl [--batch 1 16] [--calls 20] [--rounds 2] [--arms kernel reference]

Arms: `reference` (MLX), `kernel` (kernels/decode_attention_cuda.py as `block_heads` lays it out) and `kernel:N`
(the output kernel's blocks N heads each, `force_block_heads`). The arms run in the given order, then reversed,
`--rounds` times (A B C C B A). (Session 22's `kernel:N` compared row slices of the layout before the staged one:
at 9d17936 in the history.)

(Session 19's `--heads-per-block` arms timed the CUDA-core kernel's layouts; that kernel was replaced by the
tensor-core kernels in session 20, and the option with it: it is at 7bb3b78 in the history.)

`encode_us`: `mx.async_eval` of `--calls` independent calls returned, per call. `device_us`: the same calls queued
behind a spin kernel that holds the GPU (mlx_encode_cost.py's method), so the host has encoded them all before
the device starts: (arrival − the spin's own time) per call. One JSON line per (round, arm, batch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.mlx_encode_cost import spin, spin_ms  # noqa: E402
from docs.bench.probe_io import jsonl_emitter  # noqa: E402
from tessera.kernels import decode_attention_cuda  # noqa: E402
from tessera.kernels.sparse_attention import decode_mixed_attention  # noqa: E402

HEADS, DIM, WINDOW, SELECTED = 64, 512, 128, 512


def inputs(batch: int, calls: int, seed: int = 0, selected: int = SELECTED):
    """`calls` independent sets of (q, groups, sinks) for `batch` tokens, evaluated."""
    rng = np.random.default_rng(seed)
    bf16 = lambda shape: mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(mx.bfloat16)  # noqa: E731
    sets = []
    for _ in range(calls):
        groups = [(bf16((batch, WINDOW, DIM)), mx.ones((batch, WINDOW), dtype=mx.bool_)),
                  (bf16((batch, selected, DIM)), mx.array(rng.random((batch, selected)) > 0.1))]
        sets.append((bf16((batch, HEADS, DIM)), groups, mx.array(rng.uniform(0, 3, (HEADS,)).astype(np.float32))))
    mx.eval(sets)
    return sets


def measure(sets, cycles: float, spin_alone: float, repeats: int = 5) -> dict:
    encode, device = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [decode_mixed_attention(q, groups, sinks, DIM**-0.5) for q, groups, sinks in sets]
        mx.async_eval(outs)
        encode.append((time.perf_counter() - t0) * 1e6 / len(sets))
        mx.eval(outs)
        t1 = time.perf_counter()
        mx.async_eval(spin(cycles))
        outs = [decode_mixed_attention(q, groups, sinks, DIM**-0.5) for q, groups, sinks in sets]
        mx.eval(outs)
        device.append(((time.perf_counter() - t1) * 1000 - spin_alone) * 1000 / len(sets))
    return {"encode_us": statistics.median(encode[1:]), "device_us": statistics.median(device[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spin-ms", type=float, default=20.0)
    p.add_argument("--rows", type=int, default=SELECTED, help="the second group's rows a token (HCA at 1M tokens: 8192)")
    p.add_argument("--arms", nargs="+", default=["kernel", "reference"], help="reference, kernel or kernel:N (N heads a block)")
    args = p.parse_args()
    for arm in args.arms:  # a misspelt arm stops the run before anything is measured
        use_arm(arm)
    emit = jsonl_emitter(args.out)
    cycles = args.spin_ms * 1.98e6  # the H200's SM clock, ~1.98 GHz; spin_ms measures what it gives
    spin_alone = spin_ms(cycles)
    emit("spin", measured_ms=spin_alone)
    sets = {b: inputs(b, args.calls, seed=b, selected=args.rows) for b in args.batch}
    saved = decode_attention_cuda.kernel_enabled()
    try:
        for arm in (args.arms + args.arms[::-1]) * args.rounds:
            use_arm(arm)
            for batch in args.batch:
                emit("round", arm=arm, batch=batch, rows=WINDOW + args.rows, calls=args.calls,
                     block_heads=decode_attention_cuda.block_heads(HEADS), kernel_ran=decode_attention_cuda.is_supported(*sets[batch][0][:2]),
                     **measure(sets[batch], cycles, spin_alone))
    finally:
        decode_attention_cuda.set_kernel_enabled(saved)
        decode_attention_cuda.force_block_heads(None)


def use_arm(arm: str) -> None:
    """reference | kernel | kernel:N -> the switch and the output kernel's heads a block."""
    name, _, heads = arm.partition(":")
    if name not in ("kernel", "reference") or (heads and (name != "kernel" or not heads.isdigit())):
        raise SystemExit(f"--arms: {arm!r} is not reference, kernel or kernel:N")
    decode_attention_cuda.set_kernel_enabled(name == "kernel")
    try:
        decode_attention_cuda.force_block_heads(int(heads) if heads else None)
    except ValueError as refused:  # a layout the kernel's shared arrays do not hold
        raise SystemExit(f"--arms: {arm!r}: {refused}") from None


if __name__ == "__main__":
    main()
