"""`tessera check parallel`: the replay (chunked, tiled prefill + decode steps, engine/tools/replay.py) on a
local world of pipeline ranks against one process — every logit row and every indexer selection.

The ranks are child processes (`python -m tessera.engine.parallel.check --worker …`); each writes what it saw
(rank 0 the logits, every rank its layers' selections and the bytes of weights it holds) to a work
directory that this process compares with its own single-process run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tessera.engine.tools.check_limits import PARALLEL_MAX_ABS_DIFF


@dataclass(frozen=True)
class ParallelReport:
    world: int
    backend: str
    transport: str  # how the ranks moved streams: "p2p" (send/recv) or "collective" (engine/parallel/transport.py)
    tokens: int
    chunk: int
    tile: int
    decode: int
    layers_per_rank: list[list[int]]  # [start, stop) per rank
    weights_bytes_per_rank: list[int]
    single_process_weights_bytes: int
    max_abs_diff: float
    differing_selections: int
    compared_selections: int
    single_process_seconds: float  # the replay's wall time in one process (loading excluded)
    parallel_seconds: float  # the same replay on the ranks, as rank 0 saw it
    overlap: bool = False  # prefill chunks before the last were not sent back: the ranks overlapped
    compared_logit_rows: int = 0  # every row, or (overlap) the last chunk's rows and the decode rows

    def as_dict(self) -> dict:
        return asdict(self)


def check_parallel(model_dir: Path, world: int, tokens: int, chunk: int, tile: int, decode: int, seed: int = 0,
                   dtype: str = "float32", backend: str | None = None, timeout_s: float = 900,
                   overlap: bool = False) -> ParallelReport:
    """overlap: the ranks run the prefill chunks before the last without sending them back
    (PipelineStage.forward(logits=False)); their logits are not compared (nobody computes them)."""
    from tessera.engine.model.loader import load_config, load_model
    from tessera.engine.parallel.launch import new_local_world
    from tessera.engine.parallel.layout import split_layers
    from tessera.engine.tools.consistency import differing
    from tessera.engine.tools.replay import random_tokens, run_sequence

    _check_shape_args(tokens, chunk, tile, decode)
    if world < 2:
        raise ValueError(f"--world ({world}) must be at least 2: the check compares a split model with one process")
    split_layers(load_config(Path(model_dir)).num_hidden_layers, world)  # a bad world fails before any process starts
    with tempfile.TemporaryDirectory(prefix="tessera-check-parallel-") as tmp:
        work = Path(tmp)
        local = new_local_world(world, backend, work)
        _run_ranks(local, model_dir, tokens, chunk, tile, decode, seed, dtype, work, timeout_s, overlap)
        parts = [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]
        split_logits = np.load(work / "logits.npy")
    model = load_model(Path(model_dir), dtype=dtype)
    ids = random_tokens(model.cfg.vocab_size, tokens + decode, seed)
    started = time.perf_counter()
    single = run_sequence(model, ids, tokens, chunk, tile)
    single_seconds = time.perf_counter() - started
    split_selections = {(layer, pos): tuple(rows) for part in parts for layer, pos, rows in part["selections"]}
    num_diff, num_compared = differing(single.selections, split_selections)
    expected = single.logits[last_chunk_start(tokens, chunk):] if overlap else single.logits
    max_diff = float(np.abs(expected - split_logits).max()) if expected.shape == split_logits.shape else float("inf")
    return ParallelReport(
        world=world, backend=local.backend, transport=parts[0]["transport"], tokens=tokens, chunk=chunk, tile=tile, decode=decode,
        layers_per_rank=[part["layers"] for part in parts],
        weights_bytes_per_rank=[part["weights_bytes"] for part in parts],
        single_process_weights_bytes=sum(w.nbytes for w in model.weights.values()),
        max_abs_diff=max_diff, differing_selections=num_diff, compared_selections=num_compared,
        single_process_seconds=round(single_seconds, 4), parallel_seconds=round(parts[0]["seconds"], 4),
        overlap=overlap, compared_logit_rows=int(split_logits.shape[0]),
    )


def last_chunk_start(tokens: int, chunk: int) -> int:
    """Where the prompt's last prefill chunk starts (the one whose logits an overlapped run returns)."""
    return (tokens - 1) // chunk * chunk


def parallel_failures(report: ParallelReport, max_abs_diff: float = PARALLEL_MAX_ABS_DIFF) -> list[str]:
    """What makes the split run differ from one process (empty: it does not)."""
    failures = []
    if not report.max_abs_diff <= max_abs_diff:
        failures.append(f"max |Δlogit| {report.max_abs_diff} > {max_abs_diff}")
    if report.differing_selections:
        failures.append(f"{report.differing_selections} of {report.compared_selections} indexer selections differ")
    if not report.compared_selections:
        failures.append("no indexer selection was compared (no CSA layer ran, or the prompt is too short)")
    return failures


def _check_shape_args(tokens: int, chunk: int, tile: int, decode: int) -> None:
    if tokens < 1 or decode < 0:
        raise ValueError(f"--tokens ({tokens}) must be ≥ 1 and --decode ({decode}) ≥ 0")
    if not 1 <= tile <= chunk:
        raise ValueError(f"--tile ({tile}) must be between 1 and --chunk ({chunk})")


def _run_ranks(local, model_dir: Path, tokens: int, chunk: int, tile: int, decode: int, seed: int, dtype: str,
               work: Path, timeout_s: float, overlap: bool = False) -> None:
    """Every rank as a child process; any that fails (or outlives `timeout_s`) fails the check, with its log."""
    import subprocess

    from tessera.engine.parallel.launch import spawn_rank, stop_processes

    argv = ["-m", "tessera.engine.parallel.check", "--worker", "--model", str(model_dir), "--tokens", str(tokens),
            "--chunk", str(chunk), "--tile", str(tile), "--decode", str(decode), "--seed", str(seed),
            "--dtype", dtype, "--backend", local.backend, "--out", str(work)] + (["--overlap"] if overlap else [])
    procs = [spawn_rank(local, r, argv, work / f"rank{r}.log") for r in range(local.size)]
    try:
        for r, proc in enumerate(procs):
            code = proc.wait(timeout=timeout_s)
            if code != 0:
                raise RuntimeError(f"rank {r} exited with code {code}:\n{_tail(work / f'rank{r}.log')}")
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the ranks did not finish within {timeout_s:.0f} s") from None
    finally:
        stop_processes(procs, grace_s=0)


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else "(no log)"


# ---- one rank ----------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.model.trace import ForwardTrace
    from tessera.engine.parallel.launch import init_group
    from tessera.engine.parallel.serving import load_stage
    from tessera.engine.tools.replay import random_tokens

    group = init_group(args.backend)
    rank = group.rank()
    stage = load_stage(args.model, group, args.backend, dtype=args.dtype)  # as `tessera serve --world` loads it
    layers = stage.model.layer_ids
    ids = random_tokens(stage.cfg.vocab_size, args.tokens + args.decode, args.seed)
    cache, trace, rows = stage.new_cache(), ForwardTrace(record_selections=True), []
    mx.eval(mx.distributed.all_sum(mx.array([1]), group=group))  # every rank loaded: time the replay only
    started = time.perf_counter()
    for lo in range(0, args.tokens, args.chunk):  # as engine/tools/replay.py's run_sequence
        piece = ids[lo : min(lo + args.chunk, args.tokens)]
        if args.overlap and lo + args.chunk < args.tokens:  # not the last chunk: nothing comes back, no waiting
            stage.forward([Segment(cache, piece)], tile=args.tile, timer=trace, logits=False)
            continue
        rows.append(stage.forward([Segment(cache, piece)], tile=args.tile, all_logits=True, timer=trace))
    for token in ids[args.tokens :]:
        rows.append(stage.forward([Segment(cache, [token])], timer=trace))
    seconds = time.perf_counter() - started
    if rank == 0:
        np.save(args.out / "logits.npy", np.concatenate([np.array(r[0].astype(mx.float32)) for r in rows]))
    part = {"layers": [layers.start, layers.stop], "transport": stage.transport.name, "seconds": seconds, "weights_bytes": sum(w.nbytes for w in stage.weights.values()),
            "selections": [[layer, pos, list(sel)] for (layer, pos), sel in trace.selections.items()]}
    (args.out / f"rank{rank}.json").write_text(json.dumps(part))
    return 0


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.engine.parallel.check")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--chunk", type=int, required=True)
    p.add_argument("--tile", type=int, required=True)
    p.add_argument("--decode", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overlap", action="store_true")
    return _worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
