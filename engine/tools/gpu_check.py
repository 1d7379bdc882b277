"""`tessera check gpu`: everything a maintainer runs on a CUDA machine to know that tiled == untiled
there, in one go, with one table and a non-zero exit status on any violation (issue 12).

1. The kernel checks (`check kernels`: CUDA indexer and top-k kernels against their references).
2. Row invariance of the pieces a tile runs, on awkward shapes: the indexer scores and top-k of a
   row computed with the whole chunk vs in tiles of 701 rows and a last tile of 1 (inputs sliced the
   way the engine slices them), and mixed attention both ways — the raw batched call (information:
   on a GPU its bits depend on the batch, which was the fault) and the engine's fixed-block call
   (must be exact).
3. A consistency matrix: prefill with (chunk, tile) vs the same chunk untiled, in every dtype —
   prime / odd chunks, one less and one more than a power of two, tiles that do not divide the chunk,
   a last tile of one row, contexts that end inside a compression block. Every row must show
   max |Δlogit| 0.0 and 0 differing selections.
4. The device against the CPU (engine/tools/device_agreement.py): a small all-hash-routed model's layers
   and logits on short prompts, each layer from the same inputs on both, within
   DEVICE_AGREEMENT_MAX_REL_DIFF — the one part that does not compare the GPU with itself.
Decode vs a fresh whole-sequence prefill is not part of it: a different chunk shape legitimately
changes the GPU's gemms (`check consistency` reports it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from itertools import groupby
from pathlib import Path

import mlx.core as mx
import numpy as np

from tessera.engine.model.loader import load_config, load_model
from tessera.engine.tools.check_limits import KERNEL_MAX_REL_DIFF
from tessera.engine.tools.consistency import differing
from tessera.engine.tools.device_agreement import AgreementRow, agreement_violations, run_device_agreement, worst_line
from tessera.engine.tools.replay import random_tokens, run_sequence


@dataclass(frozen=True)
class Shape:
    ctx: int
    chunk: int
    tile: int
    why: str = ""


# flash-attn widths: CSA ratio 4, HCA ratio 128, window 128, top-512 (selections need > 2048 tokens).
MATRIX: tuple[Shape, ...] = (
    Shape(4096, 1024, 256, "aligned control"),
    Shape(5011, 3001, 701, "prime chunk, prime tile ∤ chunk, ctx mid-block"),
    Shape(5011, 3001, 1000, "prime chunk, last tile 1 row"),
    Shape(4099, 2047, 512, "chunk 2^11-1, ctx mid-block"),
    Shape(4099, 2049, 1024, "chunk 2^11+1, last tile 1 row"),
    Shape(3333, 1111, 333, "odd chunk, odd tile ∤ chunk"),
    Shape(3000, 1023, 100, "chunk 2^10-1, tile ∤ chunk"),
    Shape(1031, 257, 1, "chunk 2^8+1, tile 1"),
    Shape(20011, 3001, 701, "issue 12's shape"),
)
DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class MatrixRow:
    dtype: str
    ctx: int
    chunk: int
    tile: int
    why: str
    max_abs_diff: float
    differing_selections: int
    compared_selections: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff == 0.0 and self.differing_selections == 0


def consistency_matrix(model_dir: Path, shapes: tuple[Shape, ...], dtypes: tuple[str, ...], seed: int = 0,
                       log=print) -> list[MatrixRow]:
    """Tiled vs untiled prefill (same chunk) for every shape and dtype; one untiled run per
    (dtype, ctx, chunk) serves all its tiles."""
    rows = []
    for dtype in dtypes:
        model = load_model(Path(model_dir), dtype=dtype, progress=False)
        for (ctx, chunk), group in groupby(shapes, key=lambda s: (s.ctx, s.chunk)):
            tokens = random_tokens(model.cfg.vocab_size, ctx, seed)
            untiled = run_sequence(model, tokens, ctx, chunk, chunk)
            for shape in group:
                start = time.perf_counter()
                tiled = run_sequence(model, tokens, ctx, chunk, shape.tile)
                num_diff, num_compared = differing(tiled.selections, untiled.selections)
                row = MatrixRow(dtype, ctx, chunk, shape.tile, shape.why,
                                float(np.abs(tiled.logits - untiled.logits).max()), num_diff, num_compared,
                                round(time.perf_counter() - start, 2))
                log(f"  {dtype} ctx {ctx} chunk {chunk} tile {shape.tile}: |Δ| {row.max_abs_diff} "
                    f"selections {num_diff}/{num_compared}")
                rows.append(row)
    return rows


def format_matrix(rows: list[MatrixRow]) -> str:
    lines = ["| dtype | ctx | chunk | tile | shape | max \\|Δlogit\\| | differing selections | ok |",
             "|---|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.dtype} | {r.ctx} | {r.chunk} | {r.tile} | {r.why} | {r.max_abs_diff} | "
                     f"{r.differing_selections} of {r.compared_selections:,} | {'yes' if r.ok else '**NO**'} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class GpuCheckReport:
    device: str
    cuda: bool
    kernels: dict
    row_invariance: dict
    matrix: list[MatrixRow]
    agreement: list[AgreementRow]  # the device against the CPU
    violations: list[str]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["matrix"] = [asdict(r) | {"ok": r.ok} for r in self.matrix]
        return out


def invariance_tiles(rows: int) -> tuple[int, ...]:
    """Tiles for the row-invariance checks: 701 (∤ 3001, last tile 197) and 1000 (last tile 1 row)
    at the default 3001 rows; for fewer rows, the same kind of pair scaled down."""
    return (701, 1000) if rows > 1000 else (max(1, rows // 4 - 4), max(1, rows // 3))


def run_gpu_check(model_dir: Path, shapes: tuple[Shape, ...] = MATRIX, dtypes: tuple[str, ...] = DTYPES,
                  rows: int = 3001, log=print) -> GpuCheckReport:
    from tessera.kernels.cuda import on_cuda
    from tessera.kernels.device_checks import UNAVAILABLE, check_indexer_kernel, kernel_failures

    cuda = on_cuda()
    log(f"device: {mx.default_device()} (CUDA kernels {'on' if cuda else 'unavailable'})")
    kernels = check_indexer_kernel() if cuda else {"kernel": UNAVAILABLE}
    violations = kernel_failures(kernels, KERNEL_MAX_REL_DIFF, 0)  # the same verdict as `check kernels`, no row may differ
    cfg = load_config(Path(model_dir))  # the row-invariance checks run at the model's widths
    invariance = check_row_invariance(index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim, topk=cfg.index_topk,
                                      heads=cfg.num_attention_heads, head_dim=cfg.head_dim, window=cfg.sliding_window,
                                      t=rows, n=max(1, rows // 4), tiles=invariance_tiles(rows), dtypes=dtypes)
    violations += [f"row invariance: {name}" for name, ok in invariance["exact"].items() if not ok]
    matrix = consistency_matrix(model_dir, shapes, dtypes, log=log)
    violations += [f"matrix: {r.dtype} ctx {r.ctx} chunk {r.chunk} tile {r.tile}: |Δlogit| {r.max_abs_diff}, "
                   f"{r.differing_selections} selections differ" for r in matrix if not r.ok]
    agreement = run_device_agreement(mx.default_device(), log)
    violations += agreement_violations(agreement)
    return GpuCheckReport(str(mx.default_device()), cuda, kernels, invariance, matrix, agreement, violations)


def format_report(report: GpuCheckReport) -> str:
    inv = report.row_invariance
    lines = [f"device: {report.device}; CUDA kernels: {'ran' if report.cuda else 'unavailable (reference path)'}",
             "row invariance (whole batch vs tiles " + ", ".join(str(t) for t in inv["tiles"]) + "):"]
    lines += [f"  {name}: {'exact' if ok else 'DIFFERS'}" for name, ok in inv["exact"].items()]
    lines += [f"  {name}: {value} (information)" for name, value in inv["information"].items()]
    lines += ["", format_matrix(report.matrix), ""]
    lines += [f"device vs CPU ({len(report.agreement)} layers and logits): {worst_line(report.agreement)}", ""]
    lines += [f"VIOLATION: {v}" for v in report.violations] or ["no violations"]
    return "\n".join(lines)


def _tiles(length: int, tile: int) -> list[tuple[int, int]]:
    return [(r0, min(r0 + tile, length)) for r0 in range(0, length, tile)]


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b, equal_nan=True).item())


def _max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())


def check_row_invariance(t: int = 3001, n: int = 750, index_heads: int = 64, index_dim: int = 128, topk: int = 512,
                         heads: int = 64, head_dim: int = 512, window: int = 128, tiles: tuple[int, ...] = (701, 1000),
                         dtypes: tuple[str, ...] = DTYPES, seed: int = 0) -> dict:
    """A row's indexer scores, top-k and attention output computed for the whole batch of `t` rows
    vs in tiles (inputs sliced out of larger buffers, as the engine's are): exact, except the raw
    batched attention, reported for information."""
    from tessera.engine.model.dtypes import DTYPES as MX_DTYPES
    from tessera.kernels.indexer import indexer_scores, select_topk

    rng = np.random.default_rng(seed)
    arr = lambda *shape: mx.array(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    exact: dict[str, bool] = {}
    info: dict[str, float] = {}
    # Indexer: q is a slice of a larger block (offset view), keys a RowBuffer-like prefix of spare capacity.
    q = arr(t + 7, index_heads, index_dim).astype(mx.bfloat16)[5 : 5 + t]
    w = arr(t, index_heads)
    keys = arr(n + 250, index_dim).astype(mx.bfloat16)[:n]
    visible = mx.minimum((mx.arange(t) + n * 3) // 4, n)  # most rows see ≥ topk rows, the first fewer
    whole_scores = indexer_scores(q, w, keys, visible, index_dim**-0.5)
    whole_rows, whole_valid = select_topk(whole_scores, visible, topk)
    for tile in tiles:
        parts = [(indexer_scores(q[a:b], w[a:b], keys, visible[a:b], index_dim**-0.5), a, b) for a, b in _tiles(t, tile)]
        exact[f"indexer scores, tile {tile}"] = _same(mx.concatenate([p for p, _, _ in parts]), whole_scores)
        picks = [select_topk(whole_scores[a:b], visible[a:b], topk) for _, a, b in parts]
        exact[f"top-k, tile {tile}"] = (_same(mx.concatenate([r for r, _ in picks]), whole_rows)
                                        and _same(mx.concatenate([v for _, v in picks]), whole_valid))
    for dtype in dtypes:
        _attention_invariance(arr, t, heads, head_dim, window, topk, tiles, MX_DTYPES[dtype], dtype, exact, info)
    return {"shape": {"rows": t, "index_rows": n, "heads": heads, "head_dim": head_dim}, "tiles": list(tiles),
            "exact": exact, "information": info}


def _attention_invariance(arr, t, heads, head_dim, window, topk, tiles, dtype, name, exact, info) -> None:
    """Window + selected rows (CSA) and window + shared rows (HCA), whole vs tiles: the raw batched
    call (information) and the engine's fixed-block call (must be exact)."""
    from tessera.engine.model.attention import AttentionGroup, blockwise_attention
    from tessera.kernels.sparse_attention import mixed_attention, shared_rows

    q = arr(t, heads, head_dim).astype(dtype)
    sinks, scale = arr(heads), head_dim**-0.5
    win = arr(t, window, head_dim).astype(dtype)
    win_valid = mx.arange(window)[None, :] >= (window - 1 - mx.arange(t))[:, None]  # early rows see fewer
    layouts = {
        "CSA": [AttentionGroup(win, win_valid), AttentionGroup(arr(t, topk, head_dim).astype(dtype),
                                                               mx.arange(topk)[None, :] < (mx.arange(t) // 4)[:, None])],
        "HCA": [AttentionGroup(win, win_valid), AttentionGroup(arr(t // 128 + 3, head_dim).astype(dtype),
                                                               mx.arange(t // 128 + 3)[None, :] <= (mx.arange(t) // 128)[:, None],
                                                               shared=True)],
    }
    for kind, groups in layouts.items():
        def raw(a, b):  # HCA's shared rows go in broadcast, as the engine passed them before
            return mixed_attention(q[a:b], [(shared_rows(g.rows, b - a) if g.shared else g.rows[a:b], g.valid[a:b])
                                            for g in groups], sinks, scale)

        def blocks(a, b):
            tile_groups = [AttentionGroup(g.rows if g.shared else g.rows[a:b], g.valid[a:b], g.shared) for g in groups]
            return blockwise_attention(q[a:b], tile_groups, sinks, scale, a, b, t)

        whole_raw, whole_blocks = raw(0, t), blocks(0, t)
        mx.eval(whole_raw, whole_blocks)
        for tile in tiles:
            tiled_raw = mx.concatenate([raw(a, b) for a, b in _tiles(t, tile)])
            tiled_blocks = mx.concatenate([blocks(a, b) for a, b in _tiles(t, tile)])
            info[f"raw batched attention {kind} {name}, tile {tile}: max |Δ|"] = _max_diff(tiled_raw, whole_raw)
            exact[f"fixed-block attention {kind} {name}, tile {tile}"] = _same(tiled_blocks, whole_blocks)


def make_check_model(out_dir: Path, layers: int = 3) -> Path:
    """flash-attn widths (64 heads × 512, indexer 64 × 128, top-512) with window, CSA and HCA layers."""
    from tessera.engine.tools.make_model import make_model

    return make_model(Path(out_dir), "flash-attn", seed=0, with_tokenizer=False, dtype="bfloat16", layers=layers)


def parse_shape(spec: str) -> Shape:
    """'5011:3001:701' -> Shape(5011, 3001, 701)."""
    parts = spec.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"shape {spec!r}: expected CTX:CHUNK:TILE, e.g. 5011:3001:701")
    ctx, chunk, tile = (int(p) for p in parts)
    if not (1 <= tile <= chunk and 1 <= chunk and ctx >= 1):
        raise ValueError(f"shape {spec!r}: need 1 ≤ tile ≤ chunk and ctx ≥ 1")
    return Shape(ctx, chunk, tile, "given")


def check_gpu_command(model: Path | None, shape_specs: list[str] | None, dtypes: list[str] | None,
                      allow_cpu: bool, as_json: bool, rows: int = 3001, out: Path | None = None) -> int:
    """`tessera check gpu`: 0 when every check holds; 1 on any violation; 2 on bad arguments or,
    without --allow-cpu, when no CUDA device runs the kernels (a pass there would prove nothing).
    `out`: also write the report as JSON there."""
    import json
    import sys
    import tempfile

    from tessera.kernels.cuda import on_cuda

    try:
        shapes = tuple(parse_shape(s) for s in shape_specs) if shape_specs else MATRIX
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if rows < 1:
        print(f"error: --rows {rows}: need at least 1 query row", file=sys.stderr)
        return 2
    if not on_cuda() and not allow_cpu:
        print(f"error: no CUDA device ({mx.default_device()}); `check gpu` checks the CUDA path "
              "(--allow-cpu runs the reference path instead)", file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr)) if as_json else print  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model if model is not None else make_check_model(Path(tmp) / "flash-attn-3")
        report = run_gpu_check(model_dir, shapes, tuple(dtypes or DTYPES), rows, log=log)
    print(json.dumps(report.as_dict()) if as_json else format_report(report))
    if out is not None:
        Path(out).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return 1 if report.violations else 0
