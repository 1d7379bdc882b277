"""Primitives per decode step as the CUDA path builds the graph, counted on the CPU: the decode kernels
of kernels/indexer_cuda.py (single and batched indexer) and kernels/row_gather.py (batched selected-row
gather) are replaced by stand-ins that are one graph node each, as the kernel is on a CUDA device.

python docs/bench/issue14_kernel_standins.py MODEL_DIR [--batch 1 16] [--ctx 2048] [--dtype bfloat16]
    [--stacked-gather-bytes 0]   # one JSON line per batch

A stand-in first counts, into its stage, the not-yet-evaluated graph under its inputs (what the stage
boundary would have counted), evaluates those inputs, and returns zeros of the kernel's output shape
through one StopGradient node: every primitive is counted once, the kernel as one. The values are not
the kernel's (selections are the first rows), so only counts mean anything here. Everything else runs
the CPU's path (top-k reference, Sinkhorn reference, MLX gathers in the MoE): compare batch sizes and
commits, not this total with a CUDA step's. Runs on older commits too (then only the single indexer
kernel exists: the per-sequence launches that the batched kernel replaces).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

import issue14_primitive_count as counting
from tessera.engine.model import decode_attention
from tessera.engine.model.loader import load_model
from tessera.engine.tools.bench_decode import DecodeOptions, _filled
from tessera.kernels import indexer_cuda, row_gather

_trace: list[counting.CountingTrace] = []  # the trace of the step being counted


def _standin(name: str, stage: str):
    def call(inputs, output_shapes, output_dtypes, **_):
        if _trace:
            _trace[0].kinds[stage].update(counting.primitives(inputs))
        mx.eval(inputs)
        zeros = [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        mx.eval(zeros)
        return [mx.stop_gradient(z) for z in zeros]
    return call


def _standin_factory(name, inputs, outputs, source, header):
    return _standin(name, "attention" if "take_rows" in name else "indexer_score")


def install_standins() -> None:
    indexer_cuda.compiled_kernel = _standin_factory
    indexer_cuda.is_supported = lambda q: indexer_cuda.shapes_fit(q.shape[1], q.shape[-1])
    if hasattr(indexer_cuda, "batch_is_supported"):
        indexer_cuda.batch_is_supported = lambda q: indexer_cuda.shapes_fit(q.shape[1], q.shape[-1])
    if hasattr(row_gather, "batch_is_supported"):
        row_gather.compiled_kernel = _standin_factory
        row_gather.batch_is_supported = lambda xs, idx: (
            row_gather.kernel_enabled() and idx.ndim == 2 and idx.shape[1] > 0
            and (xs[0].shape[1] * xs[0].dtype.size) % row_gather.VECTOR_BYTES == 0)


def count_step(model, caches, token_ids) -> tuple[dict, list[int]]:
    trace = counting.CountingTrace()
    original = counting.CountingTrace
    _trace[:] = [trace]
    counting.CountingTrace = lambda: trace  # count_step builds its own trace: hand it this one
    try:
        return counting.count_step(model, caches, token_ids)
    finally:
        counting.CountingTrace = original
        _trace.clear()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", type=Path)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4, help="steps counted (means; one in four closes every CSA window)")
    p.add_argument("--dtype", default=None, help="e.g. bfloat16, as on the GPU (the kernels read bf16 keys)")
    p.add_argument("--stacked-gather-bytes", type=int, default=None,
                   help="decode_attention.STACKED_GATHER_BYTES (0: the per-sequence gathers a long context takes without the kernel)")
    p.add_argument("--label", default="")
    args = p.parse_args()
    install_standins()
    if args.stacked_gather_bytes is not None:
        decode_attention.STACKED_GATHER_BYTES = args.stacked_gather_bytes
    model = load_model(args.model_dir) if args.dtype is None else load_model(args.model_dir, dtype=args.dtype)
    for batch in args.batch:
        caches = [_filled(model, args.ctx, b, DecodeOptions(1024, 256, cache_fill="random")) for b in range(batch)]
        token_ids = [1] * batch
        for _ in range(2):
            token_ids = counting.step(model, caches, token_ids)
            mx.eval([c.arrays() for c in caches])
        totals, stages = [], {}
        for _ in range(args.steps):
            counts, token_ids = count_step(model, caches, token_ids)
            totals.append(counts["total"])
            for name, n in counts["per_stage"].items():
                stages[name] = stages.get(name, 0) + n / args.steps
        print(json.dumps({"label": args.label, "batch": batch, "ctx": args.ctx, "totals": totals,
                          "mean": sum(totals) / len(totals), "per_stage_mean": stages}), flush=True)


if __name__ == "__main__":
    main()
