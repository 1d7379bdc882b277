"""The Issue 14 H200 session in one process (docs/BENCHMARKS.md "Issue 14"); writes one JSON line per
measurement to stdout as soon as it exists.

python docs/bench/issue14_h200.py MODEL_DIR main     # decode 64k b1, 16k b1 vs b16 (B1 B16 B16 B1), MoE rate
python docs/bench/issue14_h200.py MODEL_DIR graphs   # decode 16k b1 only (run under MLX_USE_CUDA_GRAPHS=0/1)

The checkpoint is `make-model --preset flash-width --format official`, dequantized to bf16 on the
device here (engine/tools/quant_bench.py's helper), so every number is bf16 compute.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.loader import load_model
from tessera.engine.tools.bench import RunOptions, prefill_once
from tessera.engine.tools.bench_decode import DecodeOptions, _decode_step, _prefill, bench_decode
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.tools.quant_bench import _dequantized_model
from tessera.engine.tools.replay import random_tokens


def emit(kind: str, **row) -> None:
    print(json.dumps({"what": kind, "cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS", "default"), **row}), flush=True)


def decode_steps(model, caches, steps: int) -> list[float]:
    ids = [1] * len(caches)
    for _ in range(2):
        ids, _ = _decode_step(model, caches, ids, ForwardTrace(stage_sync=False))
    out = []
    for _ in range(steps):
        ids, s = _decode_step(model, caches, ids, ForwardTrace(stage_sync=False))
        out.append(s * 1000)
    return sorted(out)


def matmul_tflops() -> float:
    a, b = mx.random.normal((4096, 4096)).astype(mx.bfloat16), mx.random.normal((4096, 2048)).astype(mx.bfloat16)
    mx.eval(a @ b)
    start = time.perf_counter()
    mx.eval([a @ b for _ in range(20)])  # all 20 evaluated (the recorded run evaluated only the last)
    return 20 * 2 * 4096 * 4096 * 2048 / (time.perf_counter() - start) / 1e12


def main(model_dir: str, mode: str) -> None:
    t0 = time.perf_counter()
    model = _dequantized_model(load_model(Path(model_dir)), mx.bfloat16)
    emit("loaded", seconds=time.perf_counter() - t0)
    if mode == "graphs":
        caches = [_prefill(model, random_tokens(model.cfg.vocab_size, 16384, seed=0), DecodeOptions(4096, 1024))]
        steps = decode_steps(model, caches, 16)
        emit("decode_graphs", ctx=16384, batch=1, step_ms_median=steps[len(steps) // 2], step_ms=steps)
        return
    if mode == "moe":
        moe_rate(model)
        return
    emit("bench_decode", **bench_decode(model, 65536, 1, DecodeOptions(chunk=4096, tile=1024, steps=16)))
    # Batch 1 vs 16 at 16k in alternating order (B1 B16 B16 B1) on the same 16 caches.
    caches = [_prefill(model, random_tokens(model.cfg.vocab_size, 16384, seed=b), DecodeOptions(4096, 1024)) for b in range(16)]
    for batch in (1, 16, 16, 1):
        steps = decode_steps(model, caches[:batch], 12)
        median = steps[len(steps) // 2]
        emit("decode_batch", ctx=16384, batch=batch, step_ms_median=median, tokens_per_s=batch / median * 1000, step_ms=steps)
    for batch in (1, 16):  # where a step goes: every stage evaluated on its own
        ids, totals = [1] * batch, {}
        for _ in range(4):
            timer = ForwardTrace(stage_sync=True)
            ids, _ = _decode_step(model, caches[:batch], ids, timer)
            for k, v in timer.as_dict().items():
                totals[k] = totals.get(k, 0.0) + v * 1000 / 4
        emit("decode_stages_ms", ctx=16384, batch=batch, stage_ms=totals)
    del caches
    moe_rate(model)


def moe_rate(model) -> None:
    """MoE of a stage-synced prefill, and one layer's MoE block alone on 4,096 rows, against the bf16
    matmul rate measured now (second H200 run: the first one's stage-synced prefill crashed)."""
    from tessera.engine.model.moe import moe

    cfg = model.cfg
    per_token = (cfg.num_experts_per_tok + 1) * 3 * 2 * cfg.hidden_size * cfg.moe_intermediate_size
    rate = matmul_tflops()
    layer = model.layers[1].ffn  # learned routing (layer 0 is hash-routed)
    x = (mx.random.normal((4096, cfg.hidden_size)) * 0.5).astype(mx.bfloat16)
    ids = mx.arange(4096)
    mx.eval(moe(x, ids, layer, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit))
    start = time.perf_counter()
    for _ in range(5):
        mx.eval(moe(x, ids, layer, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit))
    block = (time.perf_counter() - start) / 5
    emit("moe_block", rows=4096, seconds=block, tflops=4096 * per_token / block / 1e12, bf16_matmul_tflops=rate,
         fraction_of_matmul=4096 * per_token / block / 1e12 / rate)
    tokens = random_tokens(model.cfg.vocab_size, 16384, seed=9)
    prefill_once(model, tokens[:4096], 4096, 1024, "warm-up", RunOptions(stage_sync=True))
    seconds, peak, stages = prefill_once(model, tokens, 4096, 1024, "moe", RunOptions(stage_sync=True))
    flops = len(tokens) * cfg.num_hidden_layers * (cfg.num_experts_per_tok + 1) * 3 * 2 * cfg.hidden_size * cfg.moe_intermediate_size
    rate = matmul_tflops()
    emit("moe_prefill", ctx=len(tokens), chunk=4096, prefill_seconds=seconds, stages=stages, moe_tflop=flops / 1e12,
         moe_tflops=flops / stages["moe"] / 1e12, bf16_matmul_tflops=rate, moe_fraction_of_matmul=flops / stages["moe"] / 1e12 / rate)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
