"""Engine-side CLI subcommands (make-model, check, plan, bench). `server/cli.py` owns the entry point
and calls `register`; each handler parses nothing itself and returns an exit status."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model.dtypes import DTYPES

if TYPE_CHECKING:  # the handlers import the bench (and the model loader) only when a bench runs
    from engine.tools.bench import RunOptions, Setting


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the engine's subcommands; each sets `func(args) -> int` as its handler."""
    _register_make_model(subparsers)
    _register_check(subparsers)
    _register_plan(subparsers)
    _register_bench(subparsers)
    _register_convert(subparsers)


def _register_make_model(subparsers) -> None:
    p = subparsers.add_parser("make-model", help="write a random-weight V4 checkpoint (+ tokenizer)")
    p.add_argument("dir", type=Path)
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "flash-attn", "flash-width"])
    p.add_argument("--layers", type=int, default=None, help="number of layers (window, then CSA/HCA alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--no-tokenizer", action="store_true", help="skip training the byte-level BPE tokenizer")
    _add_checkpoint_format_args(p)
    p.set_defaults(func=_make_model)


def _add_checkpoint_format_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="plain", choices=["plain", "official"],
                   help="plain: every tensor in --dtype; official: DeepSeek's FP8 dense + FP4 experts with E8M0 scales")
    p.add_argument("--config", type=Path, default=None, metavar="FILE.json",
                   help="a DeepSeek V4 config.json (transformers' field names) instead of --preset")


def _make_model(args) -> int:
    from engine.model.config import ConfigError
    from engine.model.official_format import FormatError
    from engine.tools.make_model import make_model

    overrides = {} if args.layers is None else {"layers": args.layers}
    if args.config is not None and not args.config.is_file():
        print(f"error: --config: no such file {args.config}", file=sys.stderr)
        return 2
    try:
        out = make_model(args.dir, args.preset, seed=args.seed, with_tokenizer=not args.no_tokenizer, dtype=args.dtype,
                         fmt=args.format, config_file=args.config, **overrides)
    except (ConfigError, FormatError) as exc:  # a config or shape the chosen format cannot hold
        print(f"error: {exc}", file=sys.stderr)
        return 2
    source = args.config or f"{args.preset} preset"
    print(f"wrote {args.format} checkpoint ({source}) to {out}")
    return 0


def _register_check(subparsers) -> None:
    p = subparsers.add_parser("check", help="numerical checks of a checkpoint")
    sub = p.add_subparsers(dest="check", required=True)
    ref = sub.add_parser("reference", help="Tessera vs transformers' full forward (needs the test extra)")
    ref.add_argument("--model", type=Path, required=True)
    ref.add_argument("--tokens", type=int, required=True)
    ref.add_argument("--chunk", type=int, default=None)
    ref.add_argument("--tile", type=int, default=None)
    ref.add_argument("--decode", type=int, default=0)
    ref.add_argument("--seed", type=int, default=0)
    ref.add_argument("--json", action="store_true")
    _add_reference_weight_args(ref)
    ref.set_defaults(func=_check_reference)
    con = sub.add_parser("consistency", help="tiled/chunked prefill + decode vs untiled and whole-sequence runs")
    con.add_argument("--model", type=Path, required=True)
    con.add_argument("--ctx", type=int, required=True)
    con.add_argument("--decode", type=int, default=16)
    con.add_argument("--chunk", type=int, required=True)
    con.add_argument("--tile", type=int, required=True)
    con.add_argument("--seed", type=int, default=0)
    con.add_argument("--dtype", default="float32", choices=list(DTYPES))
    con.add_argument("--json", action="store_true")
    con.set_defaults(func=_check_consistency)
    ker = sub.add_parser("kernels", help="device kernels vs their references (selections, scores, tile invariance)")
    ker.add_argument("--json", action="store_true")
    ker.set_defaults(func=_check_kernels)


def _check_kernels(args) -> int:
    from kernels.device_checks import check_indexer_kernel

    report = check_indexer_kernel()
    _print_report(report, args.json)
    return 0


def _check_reference(args) -> int:
    from engine.tools.reference_check import ReferenceUnavailable, check_reference

    if args.against is not None:
        return _check_against(args)
    try:
        report = check_reference(args.model, args.tokens, args.chunk, args.tile, args.decode, args.seed, args.weights_dtype)
    except ReferenceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_report(report.as_dict(), args.json)
    return 0


def _check_consistency(args) -> int:
    from engine.tools.consistency import check_consistency

    report = check_consistency(args.model, args.ctx, args.decode, args.chunk, args.tile, args.seed, args.dtype)
    _print_report(report.as_dict(), args.json)
    return 0 if report.differing_selections == 0 else 1


def _add_reference_weight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights-dtype", default=None, choices=["bfloat16", "float32"],
                   help="dequantize FP8/FP4/affine weights to this dtype at load (debugging) instead of quantized compute")
    p.add_argument("--against", type=Path, default=None, metavar="SRC",
                   help="compare with Tessera on checkpoint SRC (e.g. the source of a `tessera convert`): "
                        "logit KL, top-1 agreement, max |Δlogit| — no transformers needed")


def _check_against(args) -> int:
    from engine.tools.reference_check import check_against

    report = check_against(args.model, args.against, args.tokens, args.chunk, args.tile, args.decode, args.seed)
    _print_report(report.as_dict(), args.json)
    return 0


def _register_convert(subparsers) -> None:
    p = subparsers.add_parser("convert", help="rewrite a checkpoint as an MLX-native quantized one (smaller)")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--quant", required=True, choices=["affine4", "affine8", "mxfp4"])
    p.add_argument("--group-size", type=int, default=None, help="values per scale (affine: 32/64/128, default 64; mxfp4: 32)")
    p.add_argument("--dense", action="store_true", help="also requantize the dense projections (default: experts only)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_convert)


def _convert(args) -> int:
    from engine.model.loader import CheckpointError
    from engine.tools.convert import ConvertError, convert

    try:
        report = convert(args.src, args.dst, args.quant, args.group_size, args.dense)
    except (ConvertError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"{_human_bytes(report.bytes_before)} -> {_human_bytes(report.bytes_after)} "
              f"({report.bytes_after / report.bytes_before:.1%}) written to {report.destination}")
    _print_report(report.as_dict(), args.json)
    return 0


def _human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _register_plan(subparsers) -> None:
    p = subparsers.add_parser("plan", help="memory plan: chunk-scaled buffers, cache at N, weights")
    p.add_argument("--model", type=Path, default=None, help="model directory (or --preset)")
    p.add_argument("--preset", default=None, choices=["tiny", "small", "flash-attn", "v4-flash"])
    p.add_argument("--ctx", type=int, required=True)
    p.add_argument("--chunk", type=int, required=True)
    p.add_argument("--tile", type=int, default=None, help="indexer tile (default: = chunk, the untiled path)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_plan)


def _plan(args) -> int:
    from engine.model.memory_plan import format_plan, plan_for

    plan = plan_for(args.model, args.preset, args.ctx, args.chunk, args.tile or args.chunk, args.dtype)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan))
    return 0


def _register_bench(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    sub = p.add_subparsers(dest="bench", required=True)
    pre = sub.add_parser("prefill", help="prefill N random tokens, report speed, memory and stages")
    _add_prefill_run_args(pre)
    pre.add_argument("--chunk", type=int, required=True)
    pre.add_argument("--tile", type=int, default=None)
    pre.add_argument("--json", action="store_true")
    pre.set_defaults(func=_bench_prefill)
    mat = sub.add_parser("matrix", help="the five (chunk, tile) rows: markdown table + PNG plot under docs/")
    _add_prefill_run_args(mat)
    mat.add_argument("--out", type=Path, default=Path("docs"))
    mat.set_defaults(func=_bench_matrix)
    cmp = sub.add_parser("compare", help="settings in interleaved rounds (A B, B A, …), each against the first")
    _add_prefill_run_args(cmp)
    cmp.add_argument("--settings", nargs="+", required=True, type=_setting, metavar="C:T", help="chunk:tile pairs")
    cmp.add_argument("--json", action="store_true")
    cmp.set_defaults(func=_bench_compare)
    dec = sub.add_parser("decode", help="B sequences prefilled to N tokens, then batched decode steps against a bytes floor")
    dec.add_argument("--model", type=Path, required=True)
    dec.add_argument("--ctx", type=_positive, required=True, help="tokens in each sequence's cache before decoding")
    dec.add_argument("--batch", type=_positive, default=1, help="sequences decoded together in every step")
    dec.add_argument("--steps", type=_positive, default=16, help="measured decode steps (after 3 warm-up steps)")
    dec.add_argument("--chunk", type=_positive, default=4096, help="prefill chunk")
    dec.add_argument("--tile", type=_positive, default=1024, help="prefill indexer tile (at most the chunk)")
    dec.add_argument("--dtype", default=None, choices=list(DTYPES))
    dec.add_argument("--stage-sync", action="store_true",
                     help="evaluate every stage on its own for a per-stage split (attention, indexer, MoE, other)")
    dec.add_argument("--json", action="store_true")
    dec.set_defaults(func=_bench_decode)
    idx = sub.add_parser("indexer", help="indexer scoring throughput vs the device's bf16 matmul rate")
    idx.add_argument("--tile", type=int, default=1024)
    idx.add_argument("--rows", type=int, default=262144, help="compressed rows N (ctx / 4)")
    idx.add_argument("--heads", type=int, default=64)
    idx.add_argument("--dim", type=int, default=128)
    idx.add_argument("--repeat", type=int, default=5)
    idx.add_argument("--json", action="store_true")
    idx.set_defaults(func=_bench_indexer)


def _add_prefill_run_args(p: argparse.ArgumentParser) -> None:
    """What `bench prefill` and `bench matrix` share: the model, the context, how often, how synced."""
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--ctx", type=int, required=True)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=list(DTYPES))
    p.add_argument("--stage-sync", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate at every stage boundary for exact per-stage seconds (default); "
                        "--no-stage-sync evaluates only where memory needs it (tiles, layers) and "
                        "charges a stage's time to the next evaluation point")


def _run_options(args) -> RunOptions:
    from engine.tools.bench import RunOptions

    return RunOptions(repeat=args.repeat, stage_sync=args.stage_sync)


def _setting(spec: str) -> Setting:
    """'4096:1024' -> Setting(4096, 1024); argparse turns the errors into a usage message."""
    from engine.tools.bench import Setting

    chunk, sep, tile = spec.partition(":")
    if not (sep and chunk.isdigit() and tile.isdigit()):
        raise argparse.ArgumentTypeError(f"setting {spec!r}: expected C:T, e.g. 4096:1024")
    if not 1 <= int(tile) <= int(chunk):
        raise argparse.ArgumentTypeError(f"setting {spec!r}: the tile must be between 1 and the chunk")
    return Setting(int(chunk), int(tile))


def _bench_compare(args) -> int:
    from engine.tools.bench import bench_compare, compare_table

    rows = bench_compare(args.model, args.ctx, args.settings, args.dtype, _run_options(args))
    print("\n".join(json.dumps(r) for r in rows) if args.json else compare_table(rows))
    return 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def _bench_decode(args) -> int:
    from engine.tools.bench import load_for_bench
    from engine.tools.bench_decode import DecodeOptions, bench_decode

    if args.tile > args.chunk:
        print(f"error: --tile ({args.tile}) must be at most --chunk ({args.chunk})", file=sys.stderr)
        return 2
    options = DecodeOptions(chunk=args.chunk, tile=args.tile, steps=args.steps, stage_sync=args.stage_sync)
    report = bench_decode(load_for_bench(args.model, args.dtype), args.ctx, args.batch, options)
    _print_report(report, args.json)
    return 0


def _bench_indexer(args) -> int:
    from kernels.device_checks import bench_indexer

    _print_report(bench_indexer(args.tile, args.rows, args.heads, args.dim, repeat=args.repeat), args.json)
    return 0


def _bench_prefill(args) -> int:
    from engine.tools.bench import bench_prefill

    result = bench_prefill(args.model, args.ctx, args.chunk, args.tile or args.chunk, args.dtype, _run_options(args))
    _print_report(result, args.json)
    return 0


def _bench_matrix(args) -> int:
    from engine.tools.bench import bench_matrix

    table = bench_matrix(args.model, args.ctx, args.dtype, args.out, _run_options(args))
    print(table)
    return 0


def _print_report(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:>24}: {value}")


def main(argv: list[str] | None = None) -> int:
    """The engine's commands without the server's dependencies (`python -m engine.tools.commands …`),
    for machines that carry only MLX and numpy, such as the GPU box."""
    parser = argparse.ArgumentParser(prog="python -m engine.tools.commands")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
