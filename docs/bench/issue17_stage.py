"""Issue 17: what ONE pipeline rank of V4 Flash does on one GPU, at 1,048,576 tokens.

One process plays rank R of a W-rank pipeline (engine/parallel/layout.py: 43 layers over 2 ranks are
0–20 + the vocabulary on rank 0 and 21–42 on rank 1), exactly as `tessera serve --world W` loads it:
official FP8/FP4 format, random weights made on the device for that rank's layers only
(engine/model/random_weights.py; no checkpoint file), then

1. prefill of --ctx tokens in chunks of --chunk with indexer/attention tiles of --tile, through a
   subset of the rank's layers: one layer of each attention kind the rank holds (a 1M prefill through
   all 21–22 layers does not fit a 5-minute device command). Every rank layer's weights are resident,
   so the measured peak is the rank's weights + the subset's cache + the prefill workspace. The rank's
   prefill time is extrapolated per layer kind (Σ over its layers of its kind's measured seconds);
   a rank that is not the first starts from embedding-like streams (what it would receive);
2. decode at ctx --ctx through ALL the rank's layers (+ embedding and head on rank 0), every layer's
   cache filled with random rows of a prefill's shapes (engine/tools/cache_fill.py): ms per token and
   the real peak memory of the whole rank (weights + a 1M cache);
3. the memory the whole rank needs for the 1M prefill, from engine/model/memory_plan.py (its cache
   over all its layers + the planned workspace) and the measured weights, next to the subset's
   measured peak / plan ratio.

Progress goes to stdout (flushed); JSON lines to OUT (one per phase; prefill progress every 32 chunks, so a
run cut short still leaves numbers). --prefill-deadline-s stops the prefill at a chunk boundary and
says how far it got.

GPU (one H200, ~4 min):   PYTHONPATH=$PWD python3 -u docs/bench/issue17_stage.py docs/bench/h200-issue17-stage.jsonl
CPU smoke test (tiny):    PYTHONPATH=$PWD python -u docs/bench/issue17_stage.py /tmp/stage.jsonl --preset tiny \
                              --ctx 300 --chunk 64 --tile 16 --decode-steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.config import ModelConfig
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment, advance_caches, last_rows
from tessera.engine.model.dtypes import dtype_name
from tessera.engine.model.loader import load_model
from tessera.engine.model.memory_plan import cache_bytes_by_part, make_plan
from tessera.engine.model.quantized import QuantizedWeight
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.model.weights import layer_of
from tessera.engine.parallel.layout import split_layers
from tessera.engine.tools.cache_fill import fill_random
from tessera.engine.tools.make_model import preset_config, write_random_weights_dir
from tessera.engine.tools.replay import random_tokens

GiB = 2**30
KIND_NAMES = {"sliding_attention": "window", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def main() -> int:
    args = _parse()
    out = open(args.out, "a")

    def emit(record: dict) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()
        print(json.dumps(record)[:400], flush=True)

    cfg = preset_config(args.preset)
    layers = split_layers(cfg.num_hidden_layers, args.world).layers_of(args.rank)
    subset = args.prefill_layers or one_of_each_kind(cfg, layers)
    if not set(subset) <= set(layers):
        raise SystemExit(f"--prefill-layers {subset} are not all in rank {args.rank}'s layers {layers.start}..{layers.stop - 1}")
    dtype = args.dtype or ("float32" if mx.default_device() == mx.cpu else None)
    emit(dict(event="start", preset=args.preset, world=args.world, rank=args.rank, layers=[layers.start, layers.stop],
              prefill_layers=subset, ctx=args.ctx, chunk=args.chunk, tile=args.tile, device=str(mx.default_device()),
              mlx=mx.__version__))

    model = _load(cfg, layers, args, dtype, emit)
    prefill = _prefill(model, subset, args, emit)
    decode = _decode(model, args, emit)
    emit(_summary(model, layers, subset, prefill, decode, args))
    return 0


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON lines are appended here")
    p.add_argument("--preset", default="v4-flash", help="engine/tools/make_model.py preset (tiny for a CPU smoke test)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, default=0, help="0 holds window, CSA and HCA layers and the vocabulary")
    p.add_argument("--ctx", type=int, default=1_048_576)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--prefill-layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="layers to prefill through, e.g. 0,2,3 (default: the rank's first layer of each kind)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--prefill-deadline-s", type=float, default=150.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 on the CPU, the format's on a GPU)")
    return p.parse_args()


def one_of_each_kind(cfg: ModelConfig, layers: range) -> list[int]:
    first: dict[str, int] = {}
    for i in layers:
        first.setdefault(cfg.layer_types[i], i)
    return sorted(first.values())


def _load(cfg: ModelConfig, layers: range, args, dtype: str | None, emit) -> DeepseekV4:
    """The rank's layers as `serve --world` loads them from a random-weights directory."""
    with tempfile.TemporaryDirectory() as d:
        write_random_weights_dir(Path(d), cfg, seed=args.seed)
        start = time.perf_counter()
        model = load_model(Path(d), dtype=dtype, layers=layers, vocab=args.rank == 0)
        seconds = time.perf_counter() - start
    per_layer: dict[int, int] = defaultdict(int)
    modes: dict[str, int] = defaultdict(int)
    for name, w in model.weights.items():
        per_layer[layer_of(name) if layer_of(name) is not None else -1] += w.nbytes
        modes[w.mode if isinstance(w, QuantizedWeight) else str(w.dtype).replace("mlx.core.", "")] += w.nbytes
    emit(dict(event="weights", seconds=seconds, weights_bytes=sum(per_layer.values()), vocab_bytes=per_layer.pop(-1, 0),
              layer_bytes={str(i): n for i, n in sorted(per_layer.items())}, bytes_by_format=dict(modes),
              active_bytes=mx.get_active_memory(), dtype=dtype_name(model.dtype)))
    return model


def _input_streams(model: DeepseekV4, segments: list[Segment], key: mx.array, first_rank: bool) -> mx.array:
    """Rank 0 embeds the tokens; a later rank receives streams: embedding-like rows [T, hc, D]."""
    if first_rank:
        return model.embed(segments)
    rows = sum(len(s.token_ids) for s in segments)
    x = mx.random.normal((rows, model.cfg.hidden_size), key=key).astype(model.dtype)
    return mx.broadcast_to(x[:, None, :], (rows, model.cfg.hc_mult, model.cfg.hidden_size))


def _warm_up(model: DeepseekV4, subset: list[int], tokens: list[int], args) -> float:
    """Two unmeasured chunks on a throwaway cache: the first prefill in a process compiles its kernels
    (~25 s on the H200, docs/BENCHMARKS.md), which would otherwise be charged to the first layer kinds."""
    start, cache, key = time.perf_counter(), model.new_cache(), mx.random.key(args.seed + 2)
    for lo in range(0, min(2 * args.chunk, len(tokens)), args.chunk):
        segments = [Segment(cache, tokens[lo : lo + args.chunk])]
        streams = _input_streams(model, segments, key, args.rank == 0)
        for i in subset:
            streams = model.run_layers(streams, segments, range(i, i + 1), args.tile, ForwardTrace(stage_sync=False))
        mx.eval(streams)
        advance_caches(segments)
    del cache
    mx.clear_cache()
    return time.perf_counter() - start


def _prefill(model: DeepseekV4, subset: list[int], args, emit) -> dict:
    cfg = model.cfg
    tokens = random_tokens(cfg.vocab_size, args.ctx, seed=args.seed)
    warm_up_s = _warm_up(model, subset, tokens, args)
    emit(dict(event="warm_up", seconds=warm_up_s, tokens=min(2 * args.chunk, args.ctx)))
    cache = model.new_cache()
    layer_seconds: dict[int, float] = defaultdict(float)
    mx.synchronize()
    mx.reset_peak_memory()
    start, done, key = time.perf_counter(), 0, mx.random.key(args.seed)
    for n, lo in enumerate(range(0, args.ctx, args.chunk)):
        segments = [Segment(cache, tokens[lo : lo + args.chunk])]
        key, sub = mx.random.split(key)
        streams = _input_streams(model, segments, sub, args.rank == 0)
        for i in subset:
            t0 = time.perf_counter()
            streams = model.run_layers(streams, segments, range(i, i + 1), args.tile, ForwardTrace(stage_sync=False))
            mx.eval(streams)
            layer_seconds[i] += time.perf_counter() - t0
        advance_caches(segments)
        done = cache.num_tokens
        elapsed = time.perf_counter() - start
        last = done >= args.ctx
        if (n + 1) % 32 == 0 or last or elapsed > args.prefill_deadline_s:
            emit(dict(event="prefill_progress", tokens=done, seconds=elapsed, peak_bytes=mx.get_peak_memory(),
                      layer_seconds={str(i): s for i, s in layer_seconds.items()}))
        if elapsed > args.prefill_deadline_s and not last:
            print(f"prefill deadline ({args.prefill_deadline_s} s) reached at {done:,} tokens", flush=True)
            break
    by_kind: dict[str, list[float]] = defaultdict(list)
    for i, s in layer_seconds.items():
        by_kind[KIND_NAMES[cfg.layer_types[i]]].append(s)
    kinds = {k: statistics.mean(v) for k, v in by_kind.items()}  # seconds per layer of that kind
    result = dict(event="prefill", tokens=done, complete=done >= args.ctx, seconds=time.perf_counter() - start,
                  layer_seconds={str(i): s for i, s in layer_seconds.items()}, kind_seconds=kinds,
                  peak_bytes=mx.get_peak_memory(), subset_cache_bytes=cache.nbytes, active_bytes=mx.get_active_memory())
    emit(result)
    del cache
    mx.clear_cache()
    return result


def _decode(model: DeepseekV4, args, emit) -> dict:
    """One token at a time through every layer of the rank, each layer's cache at ctx (random rows)."""
    start = time.perf_counter()
    cache = fill_random(model.new_cache(), model.cfg, args.ctx, model.layer_ids, args.chunk, seed=args.seed)
    fill_seconds = time.perf_counter() - start
    mx.synchronize()
    mx.reset_peak_memory()
    key, token, step_ms = mx.random.key(args.seed + 1), 1, []
    for step in range(3 + args.decode_steps):  # 3 unmeasured warm-up steps
        segments = [Segment(cache, [token])]
        key, sub = mx.random.split(key)
        t0 = time.perf_counter()
        streams = _input_streams(model, segments, sub, args.rank == 0)
        streams = model.run_layers(streams, segments, model.layer_ids, None, ForwardTrace(stage_sync=False))
        if args.rank == 0:  # rank 0 also runs the head and samples (the streams come back to it)
            token = int(mx.argmax(model.logits(last_rows(streams, segments), segments, False)[0], axis=-1).item())
        else:
            mx.eval(streams)
        advance_caches(segments)
        if step >= 3:
            step_ms.append((time.perf_counter() - t0) * 1000)
    result = dict(event="decode", ctx=args.ctx, layers=[model.layer_ids.start, model.layer_ids.stop],
                  fill_seconds=fill_seconds, step_ms=step_ms, step_ms_median=statistics.median(step_ms),
                  kind_ms_synced=_decode_kind_ms(model, cache, args),
                  cache_bytes=cache.nbytes, cache_bytes_by_part=cache.nbytes_by_part,
                  peak_bytes=mx.get_peak_memory(), active_bytes=mx.get_active_memory())
    emit(result)
    return result


def _decode_kind_ms(model: DeepseekV4, cache, args, steps: int = 4) -> dict[str, float]:
    """ms per decode step of one layer of each kind, each layer evaluated on its own (a host sync per
    layer, so their sum exceeds the unsynced step): enough to size the other ranks' decode steps."""
    per_layer: dict[int, list[float]] = defaultdict(list)
    key = mx.random.key(args.seed + 3)
    for _ in range(steps):
        segments = [Segment(cache, [1])]
        key, sub = mx.random.split(key)
        streams = _input_streams(model, segments, sub, args.rank == 0)
        mx.eval(streams)
        for i in model.layer_ids:
            t0 = time.perf_counter()
            streams = model.run_layers(streams, segments, range(i, i + 1), None, ForwardTrace(stage_sync=False))
            mx.eval(streams)
            per_layer[i].append((time.perf_counter() - t0) * 1000)
        advance_caches(segments)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for i, times in per_layer.items():
        by_kind[KIND_NAMES[model.cfg.layer_types[i]]].append(statistics.median(times))
    return {k: statistics.mean(v) for k, v in by_kind.items()}


def _summary(model: DeepseekV4, layers: range, subset: list[int], prefill: dict, decode: dict, args) -> dict:
    """The whole rank's 1M prefill: time per layer kind × its layers, memory from the plan."""
    cfg = model.cfg
    b = model.dtype.size
    weights = sum(w.nbytes for w in model.weights.values())
    plan = make_plan(cfg, args.ctx, args.chunk, args.tile, dtype_name(model.dtype), quantized_dense=True)
    rank_cache = sum(cache_bytes_by_part(cfg, args.ctx, args.chunk, b, layers).values())
    subset_cache = sum(cache_bytes_by_part(cfg, args.ctx, args.chunk, b, subset).values())
    planned_subset = weights + subset_cache + plan.workspace_bytes
    scale = args.ctx / max(prefill["tokens"], 1)  # > 1 only if the deadline cut the prefill short (a linear underestimate)
    kind_s = prefill["kind_seconds"]
    counts = _kind_counts(cfg, layers)
    missing = sorted(k for k in counts if k not in kind_s)
    rank_prefill_s = sum(kind_s.get(k, 0.0) * n for k, n in counts.items()) * scale
    # Every rank of the layout, from the same per-kind seconds (None where a kind it holds was not measured):
    # with one request the ranks take turns, so the pipeline's prefill is their sum (+ the hops, not counted).
    per_rank = []
    for r in split_layers(cfg.num_hidden_layers, args.world).ranges:
        c = _kind_counts(cfg, r)
        per_rank.append(None if any(k not in kind_s for k in c) else sum(kind_s[k] * n for k, n in c.items()) * scale)
    return dict(
        event="summary", rank=args.rank, layers=[layers.start, layers.stop], layer_kinds=counts,
        prefill_layers=subset, prefill_tokens_measured=prefill["tokens"], prefill_kind_seconds=kind_s,
        rank_prefill_seconds_estimate=rank_prefill_s, kinds_not_measured=missing,
        prefill_seconds_estimate_per_rank=per_rank,
        decode_ms_synced_estimate_per_rank=[_decode_estimate(cfg, r, decode["kind_ms_synced"])
                                            for r in split_layers(cfg.num_hidden_layers, args.world).ranges],
        pipeline_prefill_seconds_estimate=None if None in per_rank else sum(per_rank),
        # if the ranks overlapped chunk by chunk (PipelineStage.forward(logits=False); `serve` does not yet)
        pipeline_prefill_seconds_overlapped_estimate=None if None in per_rank else max(per_rank),
        all_kind_seconds_per_layer={k: v * scale for k, v in kind_s.items()},
        decode_ms_per_token=decode["step_ms_median"], decode_peak_bytes=decode["peak_bytes"],
        weights_bytes=weights, rank_cache_bytes_at_ctx=rank_cache, workspace_bytes_planned=plan.workspace_bytes,
        prefill_peak_bytes_measured_subset=prefill["peak_bytes"], prefill_peak_bytes_planned_subset=planned_subset,
        prefill_peak_bytes_planned_rank=weights + rank_cache + plan.workspace_bytes,
        peak_over_plan_subset=prefill["peak_bytes"] / planned_subset,
    )


def _decode_estimate(cfg: ModelConfig, layers: range, kind_ms: dict[str, float]) -> float | None:
    """Σ layers × its kind's synced decode ms (None where a kind was not measured); no head, no hops."""
    counts = _kind_counts(cfg, layers)
    return None if any(k not in kind_ms for k in counts) else sum(kind_ms[k] * n for k, n in counts.items())


def _kind_counts(cfg: ModelConfig, layers) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for i in layers:
        counts[KIND_NAMES[cfg.layer_types[i]]] += 1
    return dict(counts)


if __name__ == "__main__":
    sys.exit(main())
