"""Quantized (official FP8/FP4 -> MLX mxfp8/mxfp4) vs the same weights dequantized to bf16: prefill
and decode seconds, in alternating order (Q D D Q …) in one process so drift cancels.

Run: `python -m engine.tools.quant_bench MODEL_DIR --ctx 4096 --decode 32 --rounds 2`. Per-layer
figures subtract the head (a [1, D] × [vocab, D] bf16 matmul per decode step, identical in both, and
at 4 layers a large share of a step) measured on its own, and divide by the layer count.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from engine.model.deepseek_v4 import DeepseekV4, Segment
from engine.model.loader import load_model
from engine.model.quantized import QuantizedWeight, dequantized
from engine.tools.replay import random_tokens


def _weight_bytes(model: DeepseekV4) -> int:
    return sum(w.nbytes for w in model.weights.values())


def _dequantized_model(model: DeepseekV4, dtype: mx.Dtype) -> DeepseekV4:
    weights = {k: dequantized(w, dtype) if isinstance(w, QuantizedWeight) else w for k, w in model.weights.items()}
    for w in weights.values():
        mx.eval(w)
    return DeepseekV4(model.cfg, weights)


def _run(model: DeepseekV4, tokens: list[int], ctx: int, chunk: int, decode: int) -> dict:
    cache = model.new_cache()
    mx.synchronize()
    start = time.perf_counter()
    for lo in range(0, ctx, chunk):
        mx.eval(model.forward([Segment(cache, tokens[lo : lo + chunk])])[0])
    prefill = time.perf_counter() - start
    steps = []
    for token in tokens[ctx : ctx + decode]:
        t0 = time.perf_counter()
        mx.eval(model.forward([Segment(cache, [token])])[0])
        steps.append(time.perf_counter() - t0)
    steps = sorted(steps[2:]) if len(steps) > 4 else sorted(steps)  # the first steps warm caches
    return {"prefill_s": prefill, "decode_step_s": steps[len(steps) // 2]}


def _head_seconds(model: DeepseekV4, repeat: int = 20) -> float:
    x = mx.random.normal((1, model.cfg.hidden_size)).astype(model.dtype)
    head = model.weights["head.weight"]
    mx.eval(x @ head.T)
    t0 = time.perf_counter()
    for _ in range(repeat):
        mx.eval(x @ head.T)
    return (time.perf_counter() - t0) / repeat


def bench(model_dir: Path, ctx: int, chunk: int, decode: int, rounds: int) -> dict:
    quantized = load_model(model_dir, dtype="bfloat16", progress=False)
    plain = _dequantized_model(quantized, mx.bfloat16)
    models = {"quantized": quantized, "bf16": plain}
    tokens = random_tokens(quantized.cfg.vocab_size, ctx + decode, 0)
    _run(quantized, tokens, min(ctx, 256), min(chunk, 256), 3)  # compile / warm both paths
    _run(plain, tokens, min(ctx, 256), min(chunk, 256), 3)
    results: dict[str, list[dict]] = {k: [] for k in models}
    for r in range(rounds):
        order = ["quantized", "bf16"] if r % 2 == 0 else ["bf16", "quantized"]
        for name in order:
            results[name].append(_run(models[name], tokens, ctx, chunk, decode))
    head = _head_seconds(quantized)
    layers = quantized.cfg.num_hidden_layers
    out = {"ctx": ctx, "chunk": chunk, "decode_steps": decode, "rounds": rounds, "layers": layers, "head_s": head,
           "device": str(mx.default_device())}
    for name, runs in results.items():
        prefill = sum(r["prefill_s"] for r in runs) / len(runs)
        step = sum(r["decode_step_s"] for r in runs) / len(runs)
        out[name] = {
            "weight_bytes": _weight_bytes(models[name]), "prefill_s": prefill, "prefill_tok_s": ctx / prefill,
            "prefill_s_per_layer": prefill / layers, "decode_step_s": step,
            "decode_step_s_per_layer": (step - head) / layers, "runs": runs,
        }
    out["decode_speedup"] = out["bf16"]["decode_step_s"] / out["quantized"]["decode_step_s"]
    out["prefill_speedup"] = out["bf16"]["prefill_s"] / out["quantized"]["prefill_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.tools.quant_bench")
    p.add_argument("model", type=Path)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    print(json.dumps(bench(args.model, args.ctx, args.chunk, args.decode, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
