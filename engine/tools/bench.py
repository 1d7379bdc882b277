"""`tessera bench prefill`, `bench matrix` and `bench compare`: prefill speed, MLX peak memory
against the memory plan, and per-stage time, for (chunk C, indexer tile T) settings."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from tessera.engine.model.dtypes import dtype_name
from tessera.engine.model.loader import load_model
from tessera.engine.model.memory_plan import make_plan
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment
from tessera.engine.tools.replay import random_tokens
from tessera.engine.serving.runner import default_compute_dtype
from tessera.engine.model.trace import STAGES, ForwardTrace

MATRIX = ((4096, 4096), (2048, 2048), (1024, 1024), (4096, 2048), (4096, 1024))


@dataclass(frozen=True)
class RunOptions:
    """How a bench row runs: measured prefills per row (rounds in alternating order across settings,
    see `bench_interleaved`; the mean is reported), and evaluation at every stage boundary (exact
    stage times, more host round trips)."""

    repeat: int = 1
    stage_sync: bool = True


@dataclass(frozen=True)
class Setting:
    """One (chunk C, tile T) row of a comparison; `pipelined=False` (`C:T:blocking` on the command
    line) evaluates each tile before building the next instead of building tile i+1 while tile i runs
    (only without stage syncs: a stage-synced run blocks at every stage anyway)."""

    chunk: int
    tile: int
    pipelined: bool = True

    @property
    def label(self) -> str:
        return f"C={self.chunk} T={self.tile}" + ("" if self.pipelined else " blocking")


def prefill_once(
    model: DeepseekV4, tokens: list[int], chunk: int, tile: int, label: str = "", options: RunOptions = RunOptions(),
    pipelined: bool = True,
) -> tuple[float, int, dict]:
    """-> (seconds, MLX peak bytes, stage seconds) of one prefill from an empty cache; `pipelined`:
    see `Setting`."""
    cache = model.new_cache()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    timer = ForwardTrace(stage_sync=options.stage_sync, pipeline_tiles=pipelined)
    start = time.perf_counter()
    for lo in range(0, len(tokens), chunk):
        logits = model.forward([Segment(cache, tokens[lo : lo + chunk])], tile=tile, timer=timer)
        mx.eval(logits, cache.arrays())
        _progress(label, lo + chunk, len(tokens))
    seconds = time.perf_counter() - start
    peak = mx.get_peak_memory()
    del cache, logits
    mx.clear_cache()
    return seconds, peak, timer.as_dict()


def _progress(label: str, done: int, total: int) -> None:
    done = min(done, total)
    filled = 30 * done // total
    sys.stderr.write(f"\r{label} prefill [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} tokens")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def bench_with_model(model: DeepseekV4, ctx: int, chunk: int, tile: int, options: RunOptions = RunOptions()) -> dict:
    """One setting: a warm-up, then `options.repeat` measured prefills."""
    return bench_interleaved(model, ctx, [Setting(chunk, tile)], options)[0]


def bench_interleaved(model: DeepseekV4, ctx: int, settings: Sequence[Setting], options: RunOptions = RunOptions()) -> list[dict]:
    """`options.repeat` rounds of one prefill per setting, in forward order, then backward (A B, B A,
    A B, …). Consecutive prefills in one process on the H200 slow down (measured: the fourth run 10–18 %
    slower than the first, docs/BENCHMARKS.md §4.5), so a fixed order would charge that drift to
    whichever setting runs last; over an even number of rounds a linear drift cancels.
    -> one row per setting: the mean over its rounds, and every round's seconds in "run_seconds"."""
    tokens = random_tokens(model.cfg.vocab_size, ctx, seed=0)
    for setting in settings:
        _warm_up(model, tokens, setting, options)
    runs: list[list[tuple[float, int, dict]]] = [[] for _ in settings]
    for r in range(options.repeat):
        order = range(len(settings)) if r % 2 == 0 else reversed(range(len(settings)))
        for i in order:
            label = f"{settings[i].label} round {r + 1}/{options.repeat}"
            s = settings[i]
            runs[i].append(prefill_once(model, tokens, s.chunk, s.tile, label, options, s.pipelined))
    return [_row(model, ctx, s, options, r) for s, r in zip(settings, runs)]


def _warm_up(model: DeepseekV4, tokens: list[int], setting: Setting, options: RunOptions) -> None:
    """Two chunks, not measured: kernel compilation and allocator growth would otherwise land on
    whichever setting runs first."""
    head = tokens[: min(len(tokens), 2 * setting.chunk)]
    prefill_once(model, head, setting.chunk, setting.tile, f"{setting.label} warm-up", options, setting.pipelined)


def _row(model: DeepseekV4, ctx: int, setting: Setting, options: RunOptions, runs: list[tuple[float, int, dict]]) -> dict:
    """One setting's report: the mean of its runs' seconds and stage seconds, the highest peak."""
    chunk, tile = setting.chunk, setting.tile
    seconds = statistics.mean(r[0] for r in runs)
    plan = make_plan(model.cfg, ctx, chunk, tile, dtype_name(model.dtype))
    stages = {k: statistics.mean(r[2][k] for r in runs) for k in runs[0][2]}
    peak = max(r[1] for r in runs)
    return {
        "ctx": ctx,
        "chunk": chunk,
        "tile": tile,
        "dtype": dtype_name(model.dtype),
        "repeat": len(runs),
        "stage_sync": options.stage_sync,
        "pipelined_tiles": setting.pipelined and not options.stage_sync,
        "prefill_seconds": seconds,
        "run_seconds": [r[0] for r in runs],
        "prefill_tokens_per_s": ctx / seconds,
        "peak_memory_bytes": peak,
        "planned_peak_bytes": plan.peak_bytes,
        "peak_vs_plan": peak / plan.peak_bytes,
        "weights_bytes": plan.weights_bytes,
        "planned_cache_bytes": plan.cache_bytes,
        "planned_workspace_bytes": plan.workspace_bytes,
        "stage_seconds": stages,
        **stages,
    }


def bench_compare(
    model_dir: Path, ctx: int, settings: Sequence[Setting], dtype: str | None = None, options: RunOptions = RunOptions()
) -> list[dict]:
    return bench_interleaved(_load(model_dir, dtype), ctx, settings, options)


def compare_table(rows: list[dict]) -> str:
    """Markdown: each setting against the first one."""
    first = rows[0]["prefill_tokens_per_s"]
    lines = [
        "| chunk C | tile T | tiles | tokens/s (mean of rounds) | vs first | seconds per round | peak MiB | peak/plan |",
        "|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        rounds = ", ".join(f"{s:.2f}" for s in r["run_seconds"])
        tiles = "pipelined" if r["pipelined_tiles"] else "blocking"
        lines.append(
            f"| {r['chunk']} | {r['tile']} | {tiles} | {r['prefill_tokens_per_s']:.1f} | {r['prefill_tokens_per_s'] / first:.3f} | {rounds} "
            f"| {r['peak_memory_bytes'] / 2**20:,.0f} | {r['peak_vs_plan']:.3f} |"
        )
    return "\n".join(lines)


def bench_prefill(
    model_dir: Path, ctx: int, chunk: int, tile: int, dtype: str | None = None, options: RunOptions = RunOptions()
) -> dict:
    return bench_with_model(_load(model_dir, dtype), ctx, chunk, tile, options)


def bench_matrix(
    model_dir: Path,
    ctx: int,
    dtype: str | None = None,
    out_dir: Path = Path("docs"),
    options: RunOptions = RunOptions(),
) -> str:
    """Runs the five rows in one process (interleaved rounds, see `bench_interleaved`), writes
    `bench-matrix-ctx{N}.{md,json,png}` under out_dir."""
    rows = bench_interleaved(_load(model_dir, dtype), ctx, [Setting(c, t) for c, t in MATRIX], options)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"bench-matrix-ctx{ctx}"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    table = matrix_table(rows)
    stem.with_suffix(".md").write_text(table + "\n")
    _plot(rows, stem.with_suffix(".png"))
    return table


def load_for_bench(model_dir: Path, dtype: str | None) -> DeepseekV4:
    """The model in the given compute dtype, else the device's default (float32 on CPU)."""
    return load_model(Path(model_dir), dtype=dtype or default_compute_dtype())


_load = load_for_bench


def matrix_table(rows: list[dict]) -> str:
    base = {(r["chunk"], r["tile"]): r for r in rows}
    ref_speed = base[(4096, 4096)]["prefill_tokens_per_s"]
    ref_peak = base[(1024, 1024)]["peak_memory_bytes"]
    lines = [
        "| chunk C | tile T | tokens/s | vs (4096,4096) | peak MiB | vs (1024,1024) peak | planned MiB | peak/plan | indexer s | top-k s | attention s | MoE s | other s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chunk']} | {r['tile']} | {r['prefill_tokens_per_s']:.1f} | {r['prefill_tokens_per_s'] / ref_speed:.3f} "
            f"| {r['peak_memory_bytes'] / 2**20:,.0f} | {r['peak_memory_bytes'] / ref_peak:.3f} "
            f"| {r['planned_peak_bytes'] / 2**20:,.0f} | {r['peak_vs_plan']:.3f} | "
            + " | ".join(_stage_cell(r, name) for name in STAGES)
            + " |"
        )
    return "\n".join(lines)


def _stage_cell(row: dict, name: str) -> str:
    """Seconds of one stage, or a dash for a run without stage syncs (no per-stage times)."""
    return f"{row['stage_seconds'][name]:.2f}" if name in row["stage_seconds"] else "—"


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is optional; the table and JSON carry the numbers
        print("matplotlib not installed: skipping the PNG plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["peak_memory_bytes"] / 2**30, r["prefill_tokens_per_s"])
        ax.annotate(f"C={r['chunk']}, T={r['tile']}", (r["peak_memory_bytes"] / 2**30, r["prefill_tokens_per_s"]))
    ax.set_xlabel("MLX peak memory (GiB)")
    ax.set_ylabel("prefill tokens/s")
    ax.set_title(f"prefill at ctx {rows[0]['ctx']:,} ({rows[0]['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
