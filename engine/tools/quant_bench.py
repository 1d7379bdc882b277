"""Quantized (official FP8/FP4 -> MLX mxfp8/mxfp4) vs the same weights dequantized to bf16: prefill
and decode seconds, in alternating order (Q D D Q …) in one process so drift cancels.

Run: `python -m tessera.engine.tools.quant_bench MODEL_DIR --ctx 4096 --decode 32 --rounds 2`. Three settings:
"quantized" (as served: prefill chunks of >= dense_min_rows() rows run the attention and shared-expert
projections dense on transiently dequantized weights, decode runs quantized_matmul), "quantized_qmm"
(quantized_matmul at every row count, the rule switched off) and "bf16" (every weight dequantized at
load). Per-layer figures subtract the head (a [1, D] × [vocab, D] bf16 matmul per decode step,
identical in all, and at 4 layers a large share of a step) measured on its own, and divide by the
layer count.

`--matmul PRESET` (no model directory) times single projections of a preset's widths instead, by row
count: quantized_matmul vs dequantize-per-call + matmul vs a resident dense weight, and the routed
experts' gather_qmm vs gather_mm — the numbers behind dense_min_rows (TESSERA_DENSE_MIN_ROWS). `--matmul tiny` runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment
from tessera.engine.model.loader import load_model
from tessera.engine.model import quantized as quantized_module
from tessera.engine.model.quantized import QuantizedWeight, dequantized, linear, quantize
from tessera.engine.tools.make_model import preset_config
from tessera.engine.tools.replay import random_tokens


def _weight_bytes(model: DeepseekV4) -> int:
    return sum(w.nbytes for w in model.weights.values())


def _dequantized_model(model: DeepseekV4, dtype: mx.Dtype) -> DeepseekV4:
    weights = {k: dequantized(w, dtype) if isinstance(w, QuantizedWeight) else w for k, w in model.weights.items()}
    for w in weights.values():
        mx.eval(w)
    return DeepseekV4(model.cfg, weights)


def _run(model: DeepseekV4, tokens: list[int], ctx: int, chunk: int, decode: int, dense_min_rows: int) -> dict:
    """dense_min_rows: quantized.dense_min_rows() for this run (restored after)."""
    saved = quantized_module.dense_min_rows()
    quantized_module.set_dense_min_rows(dense_min_rows)
    try:
        return _timed(model, tokens, ctx, chunk, decode)
    finally:
        quantized_module.set_dense_min_rows(saved)


def _timed(model: DeepseekV4, tokens: list[int], ctx: int, chunk: int, decode: int) -> dict:
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


NEVER_DENSE = 1 << 62  # dense_min_rows for "quantized_qmm": quantized_matmul at every row count


def bench(model_dir: Path, ctx: int, chunk: int, decode: int, rounds: int) -> dict:
    quantized = load_model(model_dir, dtype="bfloat16", progress=False)
    plain = _dequantized_model(quantized, mx.bfloat16)
    rule = quantized_module.dense_min_rows()
    settings = {"quantized": (quantized, rule), "quantized_qmm": (quantized, NEVER_DENSE), "bf16": (plain, rule)}
    tokens = random_tokens(quantized.cfg.vocab_size, ctx + decode, 0)
    for model, rows in settings.values():  # compile / warm every path (a 256-row chunk takes the dense one)
        _run(model, tokens, min(ctx, 512), min(chunk, 512), 3, rows)
    results: dict[str, list[dict]] = {k: [] for k in settings}
    for r in range(rounds):
        order = list(settings) if r % 2 == 0 else list(reversed(settings))
        for name in order:
            model, rows = settings[name]
            results[name].append(_run(model, tokens, ctx, chunk, decode, rows))
    head = _head_seconds(quantized)
    layers = quantized.cfg.num_hidden_layers
    out = {"ctx": ctx, "chunk": chunk, "decode_steps": decode, "rounds": rounds, "layers": layers, "head_s": head,
           "dense_min_rows": rule, "device": str(mx.default_device())}
    for name, runs in results.items():
        prefill = sum(r["prefill_s"] for r in runs) / len(runs)
        step = sum(r["decode_step_s"] for r in runs) / len(runs)
        out[name] = {
            "weight_bytes": _weight_bytes(settings[name][0]), "prefill_s": prefill, "prefill_tok_s": ctx / prefill,
            "prefill_s_per_layer": prefill / layers, "decode_step_s": step,
            "decode_step_s_per_layer": (step - head) / layers, "runs": runs,
        }
    for name in ("quantized", "quantized_qmm"):
        out[f"{name}_decode_speedup_vs_bf16"] = out["bf16"]["decode_step_s"] / out[name]["decode_step_s"]
        out[f"{name}_prefill_speedup_vs_bf16"] = out["bf16"]["prefill_s"] / out[name]["prefill_s"]
    return out


# ---- --matmul: single projections by row count ---------------------------------------------------


def _seconds(fn, repeat: int) -> float:
    mx.eval(fn())  # warm (compile, allocate)
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) / repeat


def _projection_times(shape: tuple[int, int], mode: str, rows: int, dtype: mx.Dtype, repeat: int) -> dict:
    """One [out, in] projection over `rows` rows: each way a quantized weight can be applied."""
    w = quantize(mx.random.normal(shape).astype(dtype), mode, 32)
    resident = w.dequantize(dtype)
    x = mx.random.normal((rows, shape[1])).astype(dtype)
    mx.eval(w.arrays(), resident, x)
    qmm = lambda: mx.quantized_matmul(x, w.values, w.scales, w.biases, transpose=True,  # noqa: E731
                                      group_size=w.group_size, bits=w.bits, mode=w.mode)
    return {"quantized_matmul_s": _seconds(qmm, repeat),
            # what the engine runs: quantized.linear (on CUDA, kernels/mxfp8_qmv.py where its rule takes it)
            "linear_s": _seconds(lambda: linear(x, w), repeat),
            "dequantize_then_matmul_s": _seconds(lambda: x @ w.dequantize(dtype).T, repeat),
            "resident_dense_s": _seconds(lambda: x @ resident.T, repeat)}


def _expert_times(cfg, rows: int, dtype: mx.Dtype, repeat: int) -> dict:
    """The routed experts' gate projection for `rows` tokens (top-k pairs each, expert-sorted)."""
    experts, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    w = quantize(mx.random.normal((experts, inter, hidden)).astype(dtype), "mxfp4", 32)
    mx.eval(w.arrays())
    pairs = rows * cfg.num_experts_per_tok
    idx = mx.sort(mx.random.randint(0, experts, (pairs,))).astype(mx.uint32)
    x = mx.random.normal((pairs, 1, hidden)).astype(dtype)
    mx.eval(idx, x)
    gqmm = lambda: mx.gather_qmm(x, w.values, w.scales, w.biases, rhs_indices=idx, transpose=True,  # noqa: E731
                                 group_size=w.group_size, bits=w.bits, mode=w.mode, sorted_indices=True)
    out = {"gather_qmm_s": _seconds(gqmm, repeat)}
    if mx.default_device() != mx.cpu:  # MLX's CPU GatherMM is float32 only, and the stack is large
        # unsorted, as moe._gather_linear runs plain experts on CUDA (a gemv per row, not the grouped GEMM)
        gmm = lambda: mx.gather_mm(x, w.dequantize(dtype).swapaxes(-1, -2), rhs_indices=idx)  # noqa: E731
        out["dequantize_then_gather_mm_s"] = _seconds(gmm, repeat)
    return out


def matmul_bench(preset: str, rows_list: list[int], repeat: int) -> dict:
    cfg = preset_config(preset)
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    # wq_a+wkv: a decode step's stacked input projection (attention_inputs.StackedInputs), the narrowest output
    projections = {"wq_a+wkv": (cfg.q_lora_rank + cfg.head_dim, cfg.hidden_size),
                   "wq_b": (cfg.num_attention_heads * cfg.head_dim, cfg.q_lora_rank),
                   "wo_b": (cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank),
                   "shared_w1": (cfg.moe_intermediate_size, cfg.hidden_size)}
    out: dict = {"preset": preset, "dtype": str(dtype), "device": str(mx.default_device()), "repeat": repeat,
                 "dense_min_rows": quantized_module.dense_min_rows(), "rows": {}}
    for rows in rows_list:
        entry = {name: _projection_times(shape, "mxfp8", rows, dtype, repeat) for name, shape in projections.items()}
        entry["experts_w1"] = _expert_times(cfg, rows, dtype, repeat)
        out["rows"][rows] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.engine.tools.quant_bench")
    p.add_argument("model", type=Path, nargs="?", help="an official-format (or converted) checkpoint")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--matmul", metavar="PRESET", help="time single projections of this preset's widths instead")
    p.add_argument("--rows", default="1,16,64,128,256,512,1024,4096", help="--matmul: row counts, comma-separated")
    p.add_argument("--repeat", type=int, default=10, help="--matmul: timed calls per measurement")
    args = p.parse_args(argv)
    if args.matmul:
        rows = [int(r) for r in args.rows.split(",")]
        print(json.dumps(matmul_bench(args.matmul, rows, args.repeat)))
        return 0
    if args.model is None:
        p.error("give a model directory, or --matmul PRESET")
    print(json.dumps(bench(args.model, args.ctx, args.chunk, args.decode, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
