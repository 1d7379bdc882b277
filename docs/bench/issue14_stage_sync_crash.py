"""Repro + bisect of the stage-synced prefill crash on the H200 (docs/BENCHMARKS.md "Issue 14",
docs/bench/issue14-h200-moe-crash.txt): `cudaLaunchHostFunc ... illegal memory access` at the MoE
stage's evaluation of the first 4,096-token chunk (flash-width, bf16, chunk 4096, tile 1024).

    python -u docs/bench/issue14_stage_sync_crash.py OUT.jsonl --model /dev/shm/fw          # H200, ~2 min
    python -u docs/bench/issue14_stage_sync_crash.py OUT.jsonl --model TINY --small         # CPU dry run

Every variant runs in its own subprocess (an illegal memory access poisons the CUDA context) and
writes one JSON line: name, exit status, whether it crashed, the error's last line, seconds.

What the variants separate (read from the code, not yet measured):
- Stage syncs are not the only difference of the crashed run: it was the first `prefill_once` of
  its process, and `prefill_once` calls `mx.clear_cache()` first (returns every cached buffer to
  the driver, among them the official checkpoint's quantized weights freed by the dequantization);
  the prefills that ran (bench_decode's `_prefill`) never clear the cache, and the MoE block that
  ran in the same process ran before it.
- MLX's sorted `gather_mm` (M = 1, `sorted_indices=True`: our MoE) goes through CUTLASS's grouped
  GEMM, whose setup kernel (mlx/backend/cuda/gemms/grouped_gemm_unaligned.cu,
  `prepare_grouped_mm_data`) computes expert g's weight pointer as
  `b_start + group * item_size * b_batch_stride` in 32-bit int: at the full V4 Flash MoE width
  (256 experts of 4096 × 2048 bf16 = 16 MiB each) that product passes 2³¹ from expert 128 on.
  Unless the compiler widened it, experts 128–255 read memory 16 MiB–2 GiB *below* the weights:
  wrong numbers while that memory is mapped, an illegal access once `clear_cache` unmapped it.
  `gather_full_width*` tests that directly (the result against a per-expert matmul), with and
  without freeing a buffer below the weights first. The engine now runs such experts in slices of
  < 2 GiB (engine/model/expert_slices.py); `*_unsliced` variants switch that off (the code that
  crashed), `synced` and `gather_full_width_sliced` run it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

VARIANTS = (  # most telling first: the budget skips the tail if loading is slow
    "gather_full_width",                     # one mx.gather_mm (sorted) vs per-expert matmuls, experts 0, 127, 128, 255
    "gather_full_width_freed",               # the same after freeing a 1 GiB buffer allocated just before the weights
    "synced_unsliced",                       # the crashed run (engine before the fix): prefill_once, stage syncs
    "synced",                                # the same with the engine's fix (experts in < 2 GiB slices)
    "unsynced_unsliced",                     # no stage syncs (prefill_once still clears the cache), fix off
    "gather_full_width_sliced",              # gather_full_width through expert_slices.sorted_gather_mm
    "synced_no_clear_unsliced",              # stage syncs, mx.clear_cache() never called, fix off
    "moe_block_after_clear_unsliced",        # one layer's MoE on 4,096 random rows right after mx.clear_cache(), fix off
    "synced_reference_kernels_unsliced",     # CUDA indexer + top-k swapped for their plain-MLX references, fix off
    "synced_contiguous_moe_input_unsliced",  # MoE input copied to a fresh contiguous array first, fix off
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--model", type=Path, required=True, help="make-model --preset flash-width --format official")
    p.add_argument("--small", action="store_true", help="CPU dry run: small gather shapes, ctx 64, chunk 32, tile 8")
    p.add_argument("--variant", default=None, help="(internal) run one variant in this process")
    p.add_argument("--only", nargs="*", default=None, help="variants to run (default: all)")
    p.add_argument("--timeout", type=int, default=60, help="seconds per variant")
    p.add_argument("--budget", type=int, default=115, help="seconds for all variants (later ones are skipped)")
    args = p.parse_args()
    if args.variant:
        return _run_variant(args)
    deadline = time.perf_counter() + args.budget
    for name in args.only or VARIANTS:
        left = deadline - time.perf_counter()
        if left < 5:
            _emit(args.out, {"variant": name, "skipped": "--budget spent"})
            continue
        cmd = [sys.executable, "-u", __file__, str(args.out), "--model", str(args.model), "--variant", name]
        cmd += ["--small"] if args.small else []
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=min(args.timeout, left))
            rc, err = done.returncode, done.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = "timeout", (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        last = [line for line in err.strip().splitlines() if line.strip()][-1:] or [""]
        row = {"variant": name, "rc": rc, "crashed": rc != 0, "error": last[0][-300:] if rc != 0 else "",
               "seconds": round(time.perf_counter() - start, 1)}
        _emit(args.out, row)
    return 0


def _emit(out: Path, row: dict) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with out.open("a") as f:
        f.write(line + "\n")


def _run_variant(args) -> int:
    import mlx.core as mx

    name = args.variant
    try:
        if name.startswith("gather_full_width"):
            result = _gather_check(mx, args.small, freed=name.endswith("freed"), sliced=name.endswith("sliced"))
        else:
            result = _prefill_variant(mx, name, args)
    except Exception:
        traceback.print_exc()
        raise
    _emit(args.out, {"variant": name, "detail": result})
    return 0


def _gather_mm(mx, x, w, experts):
    if mx.default_device() == mx.cpu and x.dtype != mx.float32:  # MLX's CPU GatherMM: float32 only
        return _gather_mm(mx, x.astype(mx.float32), w.astype(mx.float32), experts).astype(x.dtype)
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)


# ---- variants ------------------------------------------------------------------------------------

def _gather_check(mx, small: bool, freed: bool, sliced: bool) -> dict:
    from tessera.engine.model import expert_slices

    experts, out_dim, in_dim = (8, 64, 32) if small else (256, 2048, 4096)
    mx.random.seed(0)
    # CPU dry run (--small): tiny shapes and a 4-byte-per-expert limit, so the split path runs too.
    if small:
        expert_slices.GROUPED_OFFSET_LIMIT = 3 * out_dim * in_dim * 2
    below = mx.zeros((2**29,) if not small else (1024,), dtype=mx.bfloat16)  # 1 GiB just before the weights
    mx.eval(below)
    # Expert e's weight: a distinct random matrix (so a wrong expert shows), bf16.
    w = (mx.random.normal((experts, out_dim, in_dim)) * 0.02).astype(mx.bfloat16)
    mx.eval(w)
    if freed:
        del below
        mx.clear_cache()
    picks = [0, experts // 2 - 1, experts // 2, experts - 1]
    errors = {}
    # 16 rows: the sliced path's clamped form (decode-sized); 320 rows: its cut form (one host sync).
    for rows_per in (4, 80) if sliced else (4,):
        idx = mx.array(sorted(picks * rows_per), dtype=mx.uint32)
        x = (mx.random.normal((idx.size, 1, in_dim))).astype(mx.bfloat16)
        if sliced and mx.default_device() == mx.cpu:  # MLX's CPU GatherMM: float32 only
            got = expert_slices.sorted_gather_mm(x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2), idx).astype(x.dtype)
        elif sliced:
            got = expert_slices.sorted_gather_mm(x, w.swapaxes(-1, -2), idx)
        else:
            got = _gather_mm(mx, x, w, idx)
        mx.eval(got)
        for e in picks:
            rows = mx.array([i for i, v in enumerate(idx.tolist()) if v == e])
            ref = x[rows][:, 0, :] @ w[e].T  # [r, out]
            diff = mx.abs(got[rows][:, 0, :].astype(mx.float32) - ref.astype(mx.float32))
            errors[f"rows{idx.size}_expert{e}"] = float(mx.max(diff).item())
    return {"experts": experts, "expert_bytes": out_dim * in_dim * 2, "max_abs_error": errors,
            "wrong": [k for k, v in errors.items() if v > 0.25]}  # bf16 rounding: ~0.02; a wrong expert: ~1


def _prefill_variant(mx, name: str, args) -> dict:
    from tessera.engine.model.loader import load_model
    from tessera.engine.model.trace import ForwardTrace
    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.tools.bench import RunOptions, prefill_once
    from tessera.engine.tools.quant_bench import _dequantized_model
    from tessera.engine.tools.replay import random_tokens
    from tessera.engine.model import expert_slices, moe as moe_module

    # As issue14_h200.py ran it: the official checkpoint, every quantized weight dequantized to bf16.
    model = _dequantized_model(load_model(args.model), mx.bfloat16)
    ctx, chunk, tile = (64, 32, 8) if args.small else (4096, 4096, 1024)
    tokens = random_tokens(model.cfg.vocab_size, ctx, seed=9)
    if name.endswith("_unsliced"):  # the engine before the fix: one gather_mm over every expert
        expert_slices.GROUPED_OFFSET_LIMIT = 2**62
        name = name[: -len("_unsliced")]
    if name == "synced_reference_kernels":
        from tessera.kernels import indexer_cuda, topk_cuda

        indexer_cuda.is_supported = lambda *a: False
        topk_cuda.is_supported = lambda *a: False
    if name == "synced_contiguous_moe_input":
        original = moe_module.moe
        moe_module.moe = lambda x, *a: original(mx.contiguous(x) if hasattr(mx, "contiguous") else x + 0, *a)
        import tessera.engine.model.deepseek_v4 as dv4

        dv4.moe = moe_module.moe
    if name == "moe_block_after_clear":
        mx.clear_cache()
        layer, cfg = model.layers[1].ffn, model.cfg
        x = (mx.random.normal((chunk, cfg.hidden_size)) * 0.5).astype(model.dtype)
        out = moe_module.moe(x, mx.arange(chunk), layer, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
        mx.eval(out)
        return {"rows": chunk}
    if name == "synced_no_clear":
        cache, timer = model.new_cache(), ForwardTrace(stage_sync=True)
        for lo in range(0, ctx, chunk):
            mx.eval(model.forward([Segment(cache, tokens[lo : lo + chunk])], tile=tile, timer=timer), cache.arrays())
        return {"ctx": ctx, "stages": timer.as_dict()}
    seconds, peak, stages = prefill_once(model, tokens, chunk, tile, name, RunOptions(stage_sync=name != "unsynced"))
    return {"ctx": ctx, "seconds": seconds, "peak_bytes": peak, "stages": stages}


if __name__ == "__main__":
    sys.exit(main())
