"""`tessera bench decode`: B sequences prefilled to N tokens (chunked, tiled; or `--cache-fill random`:
caches of a prefill's shapes filled with random rows, engine/tools/cache_fill.py), then batched decode
steps; the step time against a floor — the bytes a step must read (weights it touches + cache rows
its attention and indexer read) at the copy bandwidth measured on the same device in the same run.

Two statistics of the measured steps, because the steps are not alike: a CSA layer's compressors close a
window every fourth token, and that step does more (pooling, norm, rotation, appends; on an H100 +0.9 ms at
batch 1, a third of a step: docs/BENCHMARKS.md, "Session 27"). `step_ms_median` is the typical step, the one
the floor comparison (`vs_floor`) reads; `step_ms_mean` is the run's time over its steps, and
`decode_tokens_per_s` comes from it — the rate a client receives over the run, closing steps included.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

import mlx.core as mx

from tessera.kernels.shapeless import compile_enabled
from tessera.engine.model.compiled import step_compile_enabled
from tessera.engine.model.config import CSA, HCA, WINDOW, ModelConfig
from tessera.engine.model.decode_async import decode_async_mode
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment
from tessera.engine.model.dtypes import dtype_name
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.serving.decode_overlap import OverlapCounts
from tessera.engine.tools.cache_fill import fill_random
from tessera.engine.tools.replay import random_tokens

# Decode stages as the report names them (engine/model/trace.py's prefill stages, the indexer's two joined).
DECODE_STAGES = {"attention": ("attention",), "indexer": ("indexer_score", "topk"), "moe": ("moe",), "other": ("other",)}


@dataclass(frozen=True)
class DecodeOptions:
    """What one `bench decode` run does: prefill chunk and indexer tile, warm-up and measured steps,
    and whether every stage is evaluated on its own (exact split, more host round trips)."""

    chunk: int = 4096
    tile: int = 1024
    steps: int = 16
    warmup: int = 3
    stage_sync: bool = False
    cache_fill: str = "prefill"  # "prefill": run the prompt; "random": random rows of a prefill's shapes (engine/tools/cache_fill.py)
    # None: time the bare forward pass + greedy argmax; True / False: the serving step (ModelRunner.execute of
    # decode-only plans) with the decode overlap on / off (engine/serving/decode_overlap.py)
    decode_overlap: bool | None = None

    def __post_init__(self) -> None:
        if self.stage_sync and self.decode_overlap is not None:
            raise ValueError("stage_sync (--stage-sync) times the bare forward pass: it cannot be combined with "
                             "decode_overlap (--decode-overlap)")


def bench_decode(model: DeepseekV4, ctx: int, batch: int, options: DecodeOptions = DecodeOptions()) -> dict:
    """Prefill `batch` sequences of different random tokens to `ctx`, then decode greedily."""
    caches = [_filled(model, ctx, b, options) for b in range(batch)]
    next_ids = [(b + 1) % model.cfg.vocab_size for b in range(batch)]  # any first decode token will do
    stage_totals = {name: 0.0 for name in DECODE_STAGES}
    extra = {}  # what only one path reports
    if options.decode_overlap is not None:
        seconds, counts = serving_step_seconds(model, caches, next_ids, options.warmup + options.steps, options)
        warmup_seconds, step_seconds = seconds[: options.warmup], seconds[options.warmup :]
        extra = {"decode_overlap_counts": dataclasses.asdict(counts)}
    else:
        warmup_seconds = []  # the first step pays for first use: kernels compiled, compiled step parts traced
        for _ in range(options.warmup):  # as the measured steps run (a stage-synced step runs its parts plain)
            next_ids, times = _decode_step(model, caches, next_ids, ForwardTrace(stage_sync=options.stage_sync))
            warmup_seconds.append(times.total)
        step_times = []
        for _ in range(options.steps):
            timer = ForwardTrace(stage_sync=options.stage_sync)
            next_ids, times = _decode_step(model, caches, next_ids, timer)
            step_times.append(times)
            for name, parts in DECODE_STAGES.items():
                stage_totals[name] += sum(timer.as_dict().get(p, 0.0) for p in parts)
        step_seconds = [t.total for t in step_times]
        if not options.stage_sync:  # stage syncs evaluate while the graph is built: no split to read
            extra = {"host_split_ms": _host_split(step_times)}
    # Cache rows are counted at the middle measured step (the cache grows by one token per step).
    cache_bytes = sum(cache_bytes_read(model.cfg, ctx + options.warmup + options.steps // 2, model.dtype.size) for _ in caches)
    weights = weights_bytes_touched(model, batch)
    bandwidth = copy_bandwidth(max(weights + cache_bytes, 2**26))
    report = _report(model, ctx, batch, options, step_seconds, stage_totals, weights, cache_bytes, bandwidth)
    return {**report, "warmup_step_ms": [s * 1000 for s in warmup_seconds], **extra}


def _host_split(step_times: list[StepTimes]) -> dict[str, float]:
    """Medians in ms of a step's build, encode and wait: with `wait` small against the other two the step is
    host-bound (the device finishes soon after the host has handed it the last kernel; docs/BENCHMARKS.md,
    "Session 12 on the H200")."""
    return {name: statistics.median(getattr(t, name) for t in step_times) * 1000 for name in ("build", "encode", "wait")}


CACHE_FILLS = ("prefill", "random")


def _filled(model: DeepseekV4, ctx: int, b: int, options: DecodeOptions):
    """Sequence b's cache at `ctx` tokens: prefilled from random tokens, or random rows of the same shapes."""
    if options.cache_fill == "random":
        return fill_random(model.new_cache(), model.cfg, ctx, model.layer_ids, options.chunk, seed=b)
    if options.cache_fill != "prefill":
        raise ValueError(f"cache_fill {options.cache_fill!r} is not one of {CACHE_FILLS}")
    return _prefill(model, random_tokens(model.cfg.vocab_size, ctx, seed=b), options)


def _prefill(model: DeepseekV4, tokens: list[int], options: DecodeOptions):
    cache = model.new_cache()
    for lo in range(0, len(tokens), options.chunk):
        logits = model.forward([Segment(cache, tokens[lo : lo + options.chunk])], tile=options.tile)
        mx.eval(logits, cache.arrays())
    return cache


@dataclass(frozen=True)
class StepTimes:
    """Where a decode step's seconds went, in the order they pass on the host."""

    build: float  # Python building the step's graph (`model.forward` returned)
    encode: float  # MLX encoding its kernels (`mx.async_eval` of the sampled ids returned)
    wait: float  # the ids on the host: what the device still had to run once the host was done

    @property
    def total(self) -> float:
        return self.build + self.encode + self.wait


def _decode_step(model: DeepseekV4, caches: list, token_ids: list[int], timer: ForwardTrace) -> tuple[list[int], StepTimes]:
    """One batched step: every sequence's next token in one forward pass, greedy sampling; -> (the
    sampled ids, its times from building the graph to the ids on the host)."""
    start = time.perf_counter()
    logits = model.forward([Segment(c, [t]) for c, t in zip(caches, token_ids)], timer=timer)
    built = time.perf_counter()
    sampled = mx.argmax(mx.concatenate(logits), axis=-1)
    mx.async_eval(sampled)
    encoded = time.perf_counter()
    ids = sampled.tolist()
    times = StepTimes(built - start, encoded - built, time.perf_counter() - encoded)
    mx.eval([c.arrays() for c in caches])  # already evaluated with the logits; keeps the graphs short
    return ids, times


def serving_step_seconds(model: DeepseekV4, caches: list, token_ids: list[int], num_steps: int,
                         options: DecodeOptions) -> tuple[list[float], OverlapCounts]:
    """Seconds of `num_steps` serving steps: ModelRunner.execute of plans decoding every cache's sequence,
    greedy, each plan made from the last step's tokens as the scheduler makes it; a step is the time from
    one plan's tokens on the host to the next's (with the overlap, the next step is already running).
    Also what the overlap did (all 0 without it)."""
    from tessera.engine.serving.protocol import DecodeSlot, SamplingParams, StepPlan
    from tessera.engine.serving.runner import ModelRunner

    max_context = max(c.num_tokens for c in caches) + num_steps + 1
    runner = ModelRunner(model, options.chunk, options.tile, max_context=max_context,
                         decode_overlap=bool(options.decode_overlap))
    greedy = SamplingParams(temperature=0.0, max_tokens=num_steps + 1, ignore_eos=True)
    request_ids = [f"seq{b}" for b in range(len(caches))]
    for request_id, cache in zip(request_ids, caches):
        runner.add_filled_request(request_id, cache, greedy)
    positions = [c.num_tokens for c in caches]
    seconds, last = [], time.perf_counter()
    for step in range(num_steps):
        plan = StepPlan(decodes=tuple(DecodeSlot(r, t, p + step) for r, t, p in zip(request_ids, token_ids, positions)))
        token_ids = [s.token_id for s in runner.execute(plan).sampled]
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
    runner.execute(StepPlan(finished_request_ids=tuple(request_ids)))  # a queued step is undone, caches released
    return seconds, runner.overlap_counts


def weights_bytes_touched(model: DeepseekV4, batch: int) -> int:
    """Bytes of weights one decode step of `batch` tokens reads: every dense tensor, the embedding
    and token → expert rows of the step's tokens, and the routed experts it uses — counted as the
    expected number of distinct experts among batch · top_k uniform picks (random-weight routing is
    close to uniform; a trained model's is not, so this is an estimate, not a measurement)."""
    cfg, total = model.cfg, 0
    for name, w in model.weights.items():
        if ".ffn.experts." in name:
            total += round(w.nbytes / w.shape[0] * expected_experts(cfg, batch))
        elif name == "embed.weight" or name.endswith("gate.tid2eid"):
            total += w.nbytes // w.shape[0] * batch
        else:
            total += w.nbytes
    return total


def expected_experts(cfg: ModelConfig, batch: int) -> float:
    """Distinct experts one layer runs for `batch` tokens of top_k distinct picks each, uniform routing."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** batch)


def cache_bytes_read(cfg: ModelConfig, num_tokens: int, itemsize: int) -> int:
    """Cache bytes one sequence's decode step reads with `num_tokens` tokens in its cache (the new one
    included): the window rows, and per CSA layer every index key plus the top-k selected compressed
    rows, per HCA layer every compressed row."""
    rows = 0
    for i, kind in enumerate(cfg.layer_types):
        rows_in = min(num_tokens, cfg.sliding_window) * cfg.head_dim
        if kind == CSA:
            n = num_tokens // cfg.compress_ratio(i)
            rows_in += n * cfg.index_head_dim + min(cfg.index_topk, n) * cfg.head_dim
        elif kind == HCA:
            rows_in += num_tokens // cfg.compress_ratio(i) * cfg.head_dim
        else:
            assert kind == WINDOW, kind
        rows += rows_in
    return rows * itemsize


def copy_bandwidth(nbytes: int, repeat: int = 5) -> float:
    """Bytes per second a device copy moves (read + write) on an array of about `nbytes` (at most
    1 GiB); the best of `repeat` copies."""
    n = min(nbytes, 2**30) // 4
    source = mx.random.uniform(shape=(n,))
    mx.eval(source)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        copied = source + 1.0
        mx.eval(copied)
        best = min(best, time.perf_counter() - start)
        del copied
    return 2 * source.nbytes / best


def _report(model, ctx, batch, options, step_seconds, stage_totals, weights, cache_bytes, bandwidth) -> dict:
    steps_ms = sorted(s * 1000 for s in step_seconds)
    median = statistics.median(steps_ms)
    mean = statistics.fmean(steps_ms)
    p90 = steps_ms[math.ceil(0.9 * len(steps_ms)) - 1]  # nearest rank
    floor_ms = (weights + cache_bytes) / bandwidth * 1000
    report = {
        "ctx": ctx,
        "batch": batch,
        "steps": options.steps,
        "chunk": options.chunk,
        "tile": options.tile,
        "dtype": dtype_name(model.dtype),
        "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "stage_sync": options.stage_sync,
        "compile": compile_enabled(),
        "compile_step": step_compile_enabled(),
        "decode_async": decode_async_mode(),
        "cache_fill": options.cache_fill,
        "path": "model" if options.decode_overlap is None else "runner",
        "decode_overlap": options.decode_overlap,
        "step_ms_median": median,
        "step_ms_mean": mean,
        "step_ms_p90": p90,
        "step_ms": [s * 1000 for s in step_seconds],
        "decode_tokens_per_s": batch / (mean / 1000),  # sustained: every measured step counts
        "bytes_read_per_step": weights + cache_bytes,
        "weights_bytes_per_step": weights,
        "cache_bytes_per_step": cache_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "floor_ms": floor_ms,
        "vs_floor": median / floor_ms,
        "stage_ms": {k: v * 1000 / options.steps for k, v in stage_totals.items()} if options.stage_sync else {},
    }
    return report
