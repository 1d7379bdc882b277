"""Engine-side CLI subcommands (make-model, check, plan, bench). `server/cli.py` owns the entry point
and calls `register`; each handler parses nothing itself and returns an exit status."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.engine.model.dtypes import DTYPES
from tessera.engine.tools.check_limits import (
    KERNEL_MAX_DIFFERING_ROWS, KERNEL_MAX_REL_DIFF, PARALLEL_MAX_ABS_DIFF, REFERENCE_MAX_ABS_DIFF,
    REFERENCE_MIN_TOP1_AGREEMENT, ConsistencyLimits,
)

if TYPE_CHECKING:  # the handlers import the bench (and the model loader) only when a bench runs
    from tessera.engine.tools.bench import RunOptions, Setting


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
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "flash-attn", "flash-width", "v4-flash"])
    p.add_argument("--layers", type=int, default=None, help="number of layers (window, then CSA/HCA alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--no-tokenizer", action="store_true", help="skip training the byte-level BPE tokenizer")
    p.add_argument("--in-memory", action="store_true",
                   help="with --format official: write no weights, only config.json + random_weights.json; every "
                        "command that loads DIR makes the random official-format weights on the device (docs/PARALLEL.md)")
    _add_checkpoint_format_args(p)
    p.set_defaults(func=_make_model)


def _add_checkpoint_format_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="plain", choices=["plain", "official"],
                   help="plain: every tensor in --dtype; official: DeepSeek's FP8 dense + FP4 experts with E8M0 scales")
    p.add_argument("--config", type=Path, default=None, metavar="FILE.json",
                   help="a DeepSeek V4 config.json (transformers' field names) instead of --preset")


def _make_model(args) -> int:
    from tessera.engine.model.config import ConfigError
    from tessera.engine.model.official_format import FormatError
    from tessera.engine.tools.make_model import make_model

    overrides = {} if args.layers is None else {"layers": args.layers}
    if args.config is not None and not args.config.is_file():
        print(f"error: --config: no such file {args.config}", file=sys.stderr)
        return 2
    try:
        out = make_model(args.dir, args.preset, seed=args.seed, with_tokenizer=not args.no_tokenizer, dtype=args.dtype,
                         fmt=args.format, config_file=args.config, in_memory=args.in_memory, **overrides)
    except (ConfigError, FormatError, ValueError) as exc:  # a config or shape the chosen format cannot hold
        print(f"error: {exc}", file=sys.stderr)
        return 2
    source = args.config or f"{args.preset} preset"
    what = "random-weights model (weights made on the device at load)" if args.in_memory else "checkpoint"
    print(f"wrote {args.format} {what} ({source}) to {out}")
    return 0


def _register_check(subparsers) -> None:
    p = subparsers.add_parser("check", help="numerical checks of a checkpoint")
    sub = p.add_subparsers(dest="check", required=True)
    _register_check_reference(sub)
    _register_check_consistency(sub)
    _register_check_parallel(sub)
    _register_check_prefix_cache(sub)
    _register_check_kernels(sub)
    _register_check_gpu(sub)
    _register_check_agreement(sub)


def _register_check_reference(sub) -> None:
    ref = sub.add_parser("reference", help="Tessera vs transformers' full forward (needs the test extra)")
    ref.add_argument("--model", type=Path, required=True)
    ref.add_argument("--tokens", type=int, required=True)
    ref.add_argument("--chunk", type=int, default=None)
    ref.add_argument("--tile", type=int, default=None)
    ref.add_argument("--decode", type=int, default=0)
    ref.add_argument("--seed", type=int, default=0)
    ref.add_argument("--max-abs-diff", type=float, default=REFERENCE_MAX_ABS_DIFF,
                     help=f"fail (exit 1) if any logit differs by more (default: {REFERENCE_MAX_ABS_DIFF})")
    ref.add_argument("--min-top1-agreement", type=float, default=REFERENCE_MIN_TOP1_AGREEMENT,
                     help=f"fail (exit 1) if fewer positions agree on the top token (default: {REFERENCE_MIN_TOP1_AGREEMENT})")
    ref.add_argument("--json", action="store_true")
    _add_reference_weight_args(ref)
    ref.set_defaults(func=_check_reference)


def _register_check_consistency(sub) -> None:
    con = sub.add_parser("consistency", help="tiled/chunked prefill + decode vs untiled and whole-sequence runs")
    con.add_argument("--model", type=Path, required=True)
    con.add_argument("--ctx", type=int, required=True)
    con.add_argument("--decode", type=int, default=16)
    con.add_argument("--chunk", type=int, required=True)
    con.add_argument("--tile", type=int, required=True)
    con.add_argument("--seed", type=int, default=0)
    con.add_argument("--dtype", default="float32", choices=list(DTYPES))
    limits = ConsistencyLimits()
    con.add_argument("--max-untiled-diff", type=float, default=limits.untiled_diff,
                     help=f"fail if tiled and untiled logits differ by more (default: {limits.untiled_diff})")
    con.add_argument("--max-whole-sequence-diff", type=float, default=limits.whole_sequence_diff,
                     help="fail if a decoded position's logits differ from a fresh whole-sequence prefill by more "
                          f"(default: {limits.whole_sequence_diff}; bf16 needs about 0.1)")
    con.add_argument("--max-differing-selections", type=int, default=limits.differing_selections,
                     help=f"fail if more indexer selections differ (default: {limits.differing_selections})")
    con.add_argument("--json", action="store_true")
    con.set_defaults(func=_check_consistency)


def _register_check_parallel(sub) -> None:
    par = sub.add_parser("parallel", help="the replay on a local world of pipeline ranks vs one process (logits, selections)")
    par.add_argument("--model", type=Path, required=True)
    par.add_argument("--world", type=int, default=2, help="number of ranks (each a local process)")
    par.add_argument("--tokens", type=int, required=True, help="prompt tokens N, prefilled in chunks")
    par.add_argument("--chunk", type=int, required=True)
    par.add_argument("--tile", type=int, required=True)
    par.add_argument("--decode", type=int, default=4, help="decode steps M after the prompt")
    par.add_argument("--seed", type=int, default=0)
    par.add_argument("--dtype", default="float32", choices=list(DTYPES))
    par.add_argument("--backend", default=None, choices=["ring", "nccl"], help="default: nccl on CUDA, else ring")
    par.add_argument("--overlap", action="store_true",
                     help="prefill chunks before the last send nothing back, so rank 0 starts the next chunk while "
                          "the later ranks run this one (the ranks overlap); compares the last chunk's and the "
                          "decode logits and every selection")
    par.add_argument("--max-abs-diff", type=float, default=PARALLEL_MAX_ABS_DIFF,
                     help=f"fail if any logit differs from one process's by more (default: {PARALLEL_MAX_ABS_DIFF})")
    par.add_argument("--json", action="store_true")
    par.set_defaults(func=_check_parallel)


def _register_check_prefix_cache(sub) -> None:
    pc = sub.add_parser("prefix-cache", help="a turn restored from the prefix cache vs the same request without it")
    pc.add_argument("--model", type=Path, required=True)
    pc.add_argument("--fill", type=_setting, default="96:32", metavar="C:T", help="chunk:tile of the turn that fills the cache")
    pc.add_argument("--reuse", type=_setting, default="64:7", metavar="C:T", help="chunk:tile of the turns that reuse it")
    pc.add_argument("--prompt-tokens", type=int, default=300)
    pc.add_argument("--seed", type=int, default=0)
    pc.add_argument("--json", action="store_true")
    pc.set_defaults(func=_check_prefix_cache)


def _register_check_kernels(sub) -> None:
    ker = sub.add_parser("kernels", help="device kernels vs their references (selections, scores, tile invariance); "
                                         "exit 2 where there is no CUDA device")
    ker.add_argument("--max-rel-diff", type=float, default=KERNEL_MAX_REL_DIFF,
                     help=f"fail if kernel scores differ from the reference by more, relative (default: {KERNEL_MAX_REL_DIFF})")
    ker.add_argument("--max-differing-rows", type=int, default=KERNEL_MAX_DIFFERING_ROWS,
                     help="fail if more query rows select other rows than the reference "
                          f"(default: {KERNEL_MAX_DIFFERING_ROWS})")
    ker.add_argument("--json", action="store_true")
    ker.set_defaults(func=_check_kernels)


def _register_check_gpu(sub) -> None:
    gpu = sub.add_parser("gpu", help="on a CUDA machine: kernel checks + tiled-vs-untiled matrix over awkward shapes "
                                     "+ the device against the CPU; exits 1 on any difference")
    gpu.add_argument("--model", type=Path, default=None, help="checkpoint (default: a flash-attn, 3-layer one in a temp dir)")
    gpu.add_argument("--shape", action="append", default=None, metavar="CTX:CHUNK:TILE", help="replace the built-in matrix")
    gpu.add_argument("--dtype", action="append", default=None, choices=list(DTYPES), help="default: bfloat16 and float32")
    gpu.add_argument("--rows", type=int, default=3001, help="query rows of the row-invariance checks")
    gpu.add_argument("--allow-cpu", action="store_true", help="run without CUDA (the reference path) instead of failing")
    gpu.add_argument("--json", action="store_true")
    gpu.add_argument("--out", type=Path, default=None, help="also write the report as JSON to this file")
    gpu.set_defaults(func=_check_gpu)


def _register_check_agreement(sub) -> None:
    ag = sub.add_parser("agreement", help="on a CUDA machine: the device against the CPU, layer by layer, in the plain and "
                                          "the official checkpoint format (check gpu's last part alone); exits 1 past the limit")
    ag.add_argument("--allow-cpu", action="store_true", help="run without CUDA (the CPU against itself) instead of failing")
    ag.add_argument("--json", action="store_true")
    ag.add_argument("--out", type=Path, default=None, help="also write the report as JSON to this file")
    ag.set_defaults(func=_check_agreement)


def _check_agreement(args) -> int:
    from tessera.engine.tools.device_agreement import check_agreement_command

    return check_agreement_command(args.allow_cpu, args.json, args.out)


def _verdict(report: dict, failures: list[str], as_json: bool) -> int:
    """Print the report with its verdict; exit status 1 if any threshold was exceeded."""
    _print_report({**report, "passed": not failures, "failures": failures}, as_json)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _check_kernels(args) -> int:
    from tessera.kernels import device_checks

    report = device_checks.check_indexer_kernel()
    if report.get("kernel") == device_checks.UNAVAILABLE:
        _print_report(report, args.json)
        print("error: no CUDA device here: the kernels were not checked", file=sys.stderr)
        return 2
    return _verdict(report, device_checks.kernel_failures(report, args.max_rel_diff, args.max_differing_rows), args.json)


def _check_gpu(args) -> int:
    from tessera.engine.tools.gpu_check import check_gpu_command

    return check_gpu_command(args.model, args.shape, args.dtype, args.allow_cpu, args.json, args.rows, args.out)


def _check_reference(args) -> int:
    from tessera.engine.tools import reference_check

    if args.against is not None:
        return _check_against(args)
    try:
        report = reference_check.check_reference(args.model, args.tokens, args.chunk, args.tile, args.decode, args.seed,
                                                 args.weights_dtype)
    except reference_check.ReferenceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _verdict(report.as_dict(), report.failures(args.max_abs_diff, args.min_top1_agreement), args.json)


def _check_consistency(args) -> int:
    from tessera.engine.tools import consistency

    report = consistency.check_consistency(args.model, args.ctx, args.decode, args.chunk, args.tile, args.seed,
                                           args.dtype)
    limits = ConsistencyLimits(args.max_untiled_diff, args.max_whole_sequence_diff, args.max_differing_selections)
    return _verdict(report.as_dict(), consistency.consistency_failures(report, limits), args.json)


def _check_prefix_cache(args) -> int:
    from tessera.engine.tools.prefix_check import check_prefix_cache

    report = check_prefix_cache(
        args.model, (args.fill.chunk, args.fill.tile), (args.reuse.chunk, args.reuse.tile), args.prompt_tokens, args.seed
    )
    differing = [f"{case['name']}: tokens or logprobs differ from the engine without the cache"
                 for case in report["cases"] if not case["identical"]]
    return _verdict(report, differing, args.json)


def _add_reference_weight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights-dtype", default=None, choices=["bfloat16", "float32"],
                   help="dequantize FP8/FP4/affine weights to this dtype at load (debugging) instead of quantized compute")
    p.add_argument("--against", type=Path, default=None, metavar="SRC",
                   help="compare with Tessera on checkpoint SRC (e.g. the source of a `tessera convert`): "
                        "logit KL, top-1 agreement, max |Δlogit| — no transformers needed")


def _check_against(args) -> int:
    from tessera.engine.tools.reference_check import check_against

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
    from tessera.engine.model.loader import CheckpointError
    from tessera.engine.tools.convert import ConvertError, convert

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


def _check_parallel(args) -> int:
    from tessera.engine.parallel.check import check_parallel, parallel_failures

    try:
        report = check_parallel(args.model, args.world, args.tokens, args.chunk, args.tile, args.decode, args.seed,
                                args.dtype, args.backend, overlap=args.overlap)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _verdict(report.as_dict(), parallel_failures(report, args.max_abs_diff), args.json)


def _register_plan(subparsers) -> None:
    p = subparsers.add_parser("plan", help="memory plan: chunk-scaled buffers, cache at N, weights")
    p.add_argument("--model", type=Path, default=None, help="model directory (or --preset)")
    p.add_argument("--preset", default=None, choices=["tiny", "small", "flash-attn", "v4-flash"])
    p.add_argument("--ctx", type=int, required=True)
    p.add_argument("--chunk", type=int, required=True)
    p.add_argument("--tile", type=int, default=None, help="indexer tile (default: = chunk, the untiled path)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES))
    p.add_argument("--json", action="store_true")
    _add_plan_weight_args(p)
    p.set_defaults(func=_plan)


def _add_plan_weight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default=None, metavar="FORMAT",
                   choices=["official", "affine4", "affine8", "mxfp4", "bfloat16", "float32", "float16"],
                   help="count the weights in this format (official FP8/FP4, a `tessera convert` format, or plain); "
                        "default: every tensor in --dtype")
    p.add_argument("--memory-budget", type=_bytes_arg, default=None, metavar="SIZE",
                   help="memory for this process, e.g. 141GiB, 192GB: says whether weights + cache + workspace fit "
                        "(exit status 1 when they do not)")


def _bytes_arg(text: str) -> int:
    """'141GiB' / '192GB' / '80G' / '1.5TiB' / '1000000' -> bytes (argparse turns errors into usage)."""
    units = {"": 1, "B": 1, "K": 2**10, "KIB": 2**10, "KB": 10**3, "M": 2**20, "MIB": 2**20, "MB": 10**6,
             "G": 2**30, "GIB": 2**30, "GB": 10**9, "T": 2**40, "TIB": 2**40, "TB": 10**12}
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].upper()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise argparse.ArgumentTypeError(f"--memory-budget {text!r}: expected a size like 141GiB, 192GB or 80G")
    return int(value * units[unit])


def _plan(args) -> int:
    from tessera.engine.model.memory_plan import format_plan, plan_for

    plan = plan_for(args.model, args.preset, args.ctx, args.chunk, args.tile or args.chunk, args.dtype,
                    args.weights, args.memory_budget)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan))
    return 1 if plan.fits is False else 0


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
    cmp.add_argument("--settings", nargs="+", required=True, type=_setting, metavar="C:T[:blocking]",
                     help="chunk:tile pairs; a ':blocking' suffix switches tile pipelining off for that setting "
                          "(each tile evaluated before the next is built), to compare it with the default "
                          "pipelined tiles in the same process, e.g. 4096:1024 4096:1024:blocking "
                          "(with --no-stage-sync: stage-synced runs always block)")
    cmp.add_argument("--json", action="store_true")
    cmp.set_defaults(func=_bench_compare)
    mt = sub.add_parser("multiturn", help="turn 2 of a conversation: time to first token with and without the prefix cache")
    mt.add_argument("--model", type=Path, required=True)
    mt.add_argument("--ctx", type=int, required=True, help="turn 2's prompt length in tokens")
    mt.add_argument("--new", type=int, default=256, help="tokens turn 2 adds after turn 1's prompt and reply")
    mt.add_argument("--reply", type=int, default=32, help="tokens of turn 1's reply")
    mt.add_argument("--chunk", type=int, default=4096)
    mt.add_argument("--tile", type=int, default=1024)
    mt.add_argument("--rounds", type=int, default=2, help="rounds of (cold, cached) in alternating order")
    mt.add_argument("--dtype", default=None, choices=list(DTYPES))
    mt.add_argument("--json", action="store_true")
    mt.set_defaults(func=_bench_multiturn)
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
    dec.add_argument("--compile", choices=["on", "off"], default=None,
                     help="compiled model functions (kernels/shapeless.py); default: TESSERA_COMPILE (on unless 0)")
    dec.add_argument("--compile-step", choices=["on", "off"], default=None,
                     help="the decode step's shape-stable parts compiled with fixed shapes (engine/model/compiled.py; "
                          "the first warm-up step traces them: see warmup_step_ms); default: TESSERA_COMPILE_STEP (unset: on with a GPU, off on the CPU)")
    dec.add_argument("--cache-fill", default="prefill", choices=["prefill", "random"],
                     help="prefill: run a random prompt of --ctx tokens first; random: give every layer's cache the "
                          "shapes a prefill in --chunk chunks leaves, filled with random rows, in seconds (decode "
                          "time depends on those sizes, not the contents: engine/tools/cache_fill.py)")
    dec.add_argument("--decode-overlap", choices=["on", "off"], default=None,
                     help="time the serving step (ModelRunner.execute of decode plans) with the decode overlap on or "
                          "off (engine/serving/decode_overlap.py) instead of the bare forward pass; not with --stage-sync")
    dec.add_argument("--decode-async", choices=["off", "inline", "thread"], default=None,
                     help="how a decode step's layers reach the device (engine/model/decode_async.py): whole step, "
                          "each layer in this thread, or each layer on the encode thread; default: TESSERA_DECODE_ASYNC")
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
    from tessera.engine.tools.bench import RunOptions

    return RunOptions(repeat=args.repeat, stage_sync=args.stage_sync)


def _setting(spec: str) -> Setting:
    """'4096:1024' -> Setting(4096, 1024); '4096:1024:blocking' -> the same with tile pipelining off;
    argparse turns the errors into a usage message."""
    from tessera.engine.tools.bench import Setting

    chunk, sep, rest = spec.partition(":")
    tile, _, mode = rest.partition(":")
    if not (sep and chunk.isdigit() and tile.isdigit()) or mode not in ("", "blocking"):
        raise argparse.ArgumentTypeError(f"setting {spec!r}: expected C:T or C:T:blocking, e.g. 4096:1024")
    if not 1 <= int(tile) <= int(chunk):
        raise argparse.ArgumentTypeError(f"setting {spec!r}: the tile must be between 1 and the chunk")
    return Setting(int(chunk), int(tile), pipelined=mode != "blocking")


def _bench_compare(args) -> int:
    from tessera.engine.tools.bench import bench_compare, compare_table

    rows = bench_compare(args.model, args.ctx, args.settings, args.dtype, _run_options(args))
    print("\n".join(json.dumps(r) for r in rows) if args.json else compare_table(rows))
    return 0


def _bench_multiturn(args) -> int:
    from tessera.engine.tools.bench_multiturn import bench_multiturn

    if not (0 < args.new and 0 < args.reply and args.new + args.reply < args.ctx):
        print("error: --new and --reply must be positive and leave turn 1 a prompt (new + reply < ctx)", file=sys.stderr)
        return 2
    result = bench_multiturn(args.model, args.ctx, args.new, args.reply, args.chunk, args.tile, args.rounds, args.dtype)
    if args.json:
        print(json.dumps(result))
    else:
        _print_report({k: v for k, v in result.items() if k != "runs"}, False)
    return 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def _bench_decode(args) -> int:
    from tessera.engine.tools.bench import load_for_bench
    from tessera.engine.tools.bench_decode import DecodeOptions, bench_decode

    if args.tile > args.chunk:
        print(f"error: --tile ({args.tile}) must be at most --chunk ({args.chunk})", file=sys.stderr)
        return 2
    if args.compile is not None:
        from tessera.kernels.shapeless import set_compile_enabled

        set_compile_enabled(args.compile == "on")
    if args.compile_step is not None:
        from tessera.engine.model.compiled import set_step_compile_enabled

        set_step_compile_enabled(args.compile_step == "on")
    if args.decode_async is not None:
        from tessera.engine.model.decode_async import set_decode_async_mode

        set_decode_async_mode(args.decode_async)
    overlap = None if args.decode_overlap is None else args.decode_overlap == "on"
    try:
        options = DecodeOptions(chunk=args.chunk, tile=args.tile, steps=args.steps, stage_sync=args.stage_sync,
                                cache_fill=args.cache_fill, decode_overlap=overlap)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = bench_decode(load_for_bench(args.model, args.dtype), args.ctx, args.batch, options)
    _print_report(report, args.json)
    return 0


def _bench_indexer(args) -> int:
    from tessera.kernels.device_checks import bench_indexer

    _print_report(bench_indexer(args.tile, args.rows, args.heads, args.dim, repeat=args.repeat), args.json)
    return 0


def _bench_prefill(args) -> int:
    from tessera.engine.tools.bench import bench_prefill

    result = bench_prefill(args.model, args.ctx, args.chunk, args.tile or args.chunk, args.dtype, _run_options(args))
    _print_report(result, args.json)
    return 0


def _bench_matrix(args) -> int:
    from tessera.engine.tools.bench import bench_matrix

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
    """The engine's commands without the server's dependencies (`python -m tessera.engine.tools.commands …`),
    for machines that carry only MLX and numpy, such as the GPU box."""
    parser = argparse.ArgumentParser(prog="python -m tessera.engine.tools.commands")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
