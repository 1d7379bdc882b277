"""`tessera serve --world N`: rank 0 runs HTTP, the scheduler and the sampler; ranks 1…N-1 follow its steps.

Rank 0's runner is the ordinary ModelRunner over a PipelineStage (engine/parallel/pipeline.py); before
each step it sends the followers a StepMessage (the plan's finished and new request ids and its tokens),
broadcast by the stage's transport (engine/parallel/transport.py). A follower keeps its layers' caches per
request and runs each plan through its layers, in the order ModelRunner.execute puts the segments (decodes, then the prefill chunk).

Failure is loud: a follower process that exits is seen by RankWatch within 0.2 s and rank 0 exits with
an error (the pipeline cannot go on without its layers). Any step that raises on rank 0 (a lost peer makes
MLX's transport raise) exits it too: after a failure mid-step the ranks are out of step, so the one-process
policy (fail the step's requests, go on) does not apply. When rank 0 goes, the followers' next receive
fails and they exit.
Shutdown: at exit rank 0 sends `stop` and waits for the followers.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from tessera.engine.model.cache import SequenceCache
from tessera.engine.model.config import ModelConfig
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_config, load_model
from tessera.engine.model.memory_plan import cache_bytes_at
from tessera.engine.parallel.launch import (RankWatch, init_group, join_world, launched_world, new_local_world, spawn_rank,
                                    stop_processes)
from tessera.engine.parallel.layout import StageLayout, split_layers
from tessera.engine.parallel.messages import StepMessage
from tessera.engine.parallel.pipeline import PipelineStage
from tessera.engine.parallel.transport import make_transport
from tessera.engine.serving.protocol import StepOutput, StepPlan
from tessera.engine.serving.runner import ModelRunner, default_compute_dtype

logger = logging.getLogger("tessera.parallel")

RANK_LOST_EXIT_CODE = 3
_STOP_GRACE_S = 10.0
# How old the followers' memory in rank 0's snapshot may get while steps run: their all_gather joins one step
# in this many seconds, not every step (a decode step is milliseconds; the gauges are read per scrape).
MEMORY_GATHER_INTERVAL_S = 1.0


class PipelineRunner:
    """The Runner of rank 0: tells the followers each step, then runs it through the pipeline."""

    def __init__(self, runner: ModelRunner, stage: PipelineStage,
                 name_lost_rank: Callable[[], None] | None = None,
                 memory_gather_interval_s: float = MEMORY_GATHER_INTERVAL_S) -> None:
        self._runner, self._stage = runner, stage
        self._name_lost_rank = name_lost_rank  # exits naming the follower if one died (local world only)
        self._stopped = False
        self._follower_memory: dict[str, int] = {}
        self._memory_gather_interval_s = memory_gather_interval_s
        self._last_memory_gather: float | None = None  # time.monotonic() of the last gather; None: never

    def execute(self, plan: StepPlan) -> StepOutput:
        try:
            return self._execute(plan)
        except Exception:  # noqa: BLE001 — any failure mid-step leaves the ranks out of step
            if self._name_lost_rank is not None:
                self._name_lost_rank()
            logger.critical("a pipelined step failed on rank 0; the ranks are out of step, exiting", exc_info=True)
            sys.stderr.flush()
            os._exit(RANK_LOST_EXIT_CODE)

    def _execute(self, plan: StepPlan) -> StepOutput:
        gather = self._gathers_memory(plan)
        self._tell(StepMessage.of(plan, gather_memory=gather))
        output = self._runner.execute(plan)
        if gather:  # the followers join it because the message said so
            rows = gather_memory(self._stage.group, 0, 0)  # rank 0's own row is unused: its snapshot is local
            self._follower_memory = {f"rank{r}_{kind}": int(v) for r in range(1, len(rows))
                                     for kind, v in zip(MEMORY_KINDS, rows[r])}
        return output

    def _gathers_memory(self, plan: StepPlan) -> bool:
        """The first step that runs tokens, then one every `memory_gather_interval_s`."""
        if not plan.num_tokens:
            return False
        now = time.monotonic()
        last = self._last_memory_gather
        if last is not None and now - last < self._memory_gather_interval_s:
            return False
        self._last_memory_gather = now
        return True

    def match_prefix(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        """No prefix cache across ranks yet: every rank would have to restore the same state."""
        return 0

    def cache_bytes_at(self, num_tokens: int) -> int:
        """One sequence's cache on the rank that holds the most of it: admission is per GPU (memory_budget)."""
        cfg, layout = self._stage.cfg, split_layers(self._stage.cfg.num_hidden_layers, self._stage.world)
        return max_stage_cache_bytes(cfg, layout, num_tokens, self._stage.dtype.size)

    def memory_snapshot(self) -> dict[str, int]:
        """Rank 0's own kinds, and each follower's as `rank{r}_{kind}` (as of the last gather: a step at most
        `memory_gather_interval_s` before the last one)."""
        return {**self._runner.memory_snapshot(), **self._follower_memory}

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._tell(StepMessage(stop=True))

    def _tell(self, message: StepMessage) -> None:
        self._stage.transport.broadcast_bytes(message.encode())


def run_follower(stage: PipelineStage, indexer_tile: int) -> int:
    """A follower's life: receive each step from rank 0 (the transport's broadcast), run it; until `stop`."""
    caches: dict[str, SequenceCache] = {}
    weights_bytes = sum(w.nbytes for w in stage.weights.values())
    while True:
        message = StepMessage.decode(stage.transport.broadcast_bytes(None))
        if message.stop:
            return 0
        for request_id in message.released:  # in ModelRunner.execute's order: drop, then set up, then run
            caches.pop(request_id, None)
        for request_id in message.added:
            caches[request_id] = stage.new_cache()
        segments = plan_segments(message.plan, caches)
        if segments:
            stage.forward(segments, tile=indexer_tile)
        if message.gather_memory:
            gather_memory(stage.group, weights_bytes, sum(c.nbytes for c in caches.values()))


def max_stage_cache_bytes(cfg: ModelConfig, layout: StageLayout, num_tokens: int, dtype_bytes: int) -> int:
    return max(cache_bytes_at(cfg, num_tokens, dtype_bytes, layers) for layers in layout.ranges)


MEMORY_KINDS = ("weights", "kv_cache", "mlx_active", "mlx_peak", "mlx_cache")


def gather_memory(group: mx.distributed.Group, weights_bytes: int, kv_cache_bytes: int) -> np.ndarray:
    """Every rank's memory after a step ([world, len(MEMORY_KINDS)] bytes, rounded down to KiB): one small
    all_gather, which every rank calls at the same point of a step whose StepMessage says `gather_memory`."""
    row = [weights_bytes, kv_cache_bytes, mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory()]
    # int32 KiB (up to 2 TiB): GPUs have no float64 and not every backend moves 64-bit integers
    kib = mx.array([[n // 1024 for n in row]], dtype=mx.int32)
    return np.array(mx.distributed.all_gather(kib, group=group)).astype(np.int64) * 1024


def plan_segments(plan: StepPlan, caches: dict[str, SequenceCache]) -> list[Segment]:
    """The plan's segments in ModelRunner.execute's order: every decode, then the prefill chunk."""
    segments = [Segment(caches[slot.request_id], [slot.token_id]) for slot in plan.decodes]
    if plan.prefill is not None:
        segments.append(Segment(caches[plan.prefill.request_id], list(plan.prefill.token_ids)))
    return segments


def load_stage(model_dir: Path, group: mx.distributed.Group, backend: str, dtype: str | None = None) -> PipelineStage:
    """This rank's layers of the model (and the vocabulary on rank 0) with its transport. dtype None: the
    serving default (default_compute_dtype)."""
    cfg = load_config(model_dir)
    layers = split_layers(cfg.num_hidden_layers, group.size()).layers_of(group.rank())
    model = load_model(model_dir, dtype=dtype or default_compute_dtype(), layers=layers, vocab=group.rank() == 0)
    logger.info("rank %d holds layers %d..%d", group.rank(), layers.start, layers.stop - 1)
    transport = make_transport(group, backend)
    logger.info("rank %d moves streams and steps by %s", group.rank(), transport.name)
    return PipelineStage(model, group, transport)


def build_pipeline_runner(model_dir: Path, world: int, prefill_chunk: int, indexer_tile: int,
                          max_context: int | None = None, stage_timing_interval: int = 1,
                          backend: str | None = None) -> PipelineRunner:
    """Start ranks 1…world-1 on this machine, join as rank 0 and build its runner (the model's first layers).
    Under `mlx.launch` (the world exists already, every rank runs `tessera serve`) only join it."""
    split_layers(load_config(model_dir).num_hidden_layers, world)  # a bad world fails before any process starts
    shape = (prefill_chunk, indexer_tile, max_context, stage_timing_interval)
    launched = launched_world()
    if launched is not None:
        group = join_launched_world(world, launched[1])
        if group.rank() != 0:
            raise RuntimeError(f"rank {group.rank()} builds no runner: it follows rank 0 (engine/parallel/follower.py)")
        runner = _rank_0_runner(load_stage(Path(model_dir), group, launched[1]), *shape)
        atexit.register(_shut_down, runner, None, {})  # the launcher owns the processes (and stops all if one fails)
        return runner
    local = new_local_world(world, backend)
    argv = ["-m", "tessera.engine.parallel.follower", "--model", str(model_dir), "--tile", str(indexer_tile),
            "--backend", local.backend]
    followers = {rank: spawn_rank(local, rank, argv) for rank in range(1, world)}
    for rank, proc in followers.items():
        logger.info("started rank %d (pid %d)", rank, proc.pid)
    watch = RankWatch(followers, lambda rank, code: _rank_lost(rank, code, followers))
    try:
        runner = _rank_0_runner(load_stage(Path(model_dir), join_world(local, 0), local.backend), *shape,
                                name_lost_rank=lambda: _name_lost_follower(followers))
    except BaseException:
        watch.expect_exit()
        stop_processes(list(followers.values()), grace_s=0)
        raise
    atexit.register(_shut_down, runner, watch, followers)
    return runner


def _rank_0_runner(stage: PipelineStage, prefill_chunk: int, indexer_tile: int, max_context: int | None,
                   stage_timing_interval: int, name_lost_rank: Callable[[], None] | None = None) -> PipelineRunner:
    # ModelRunner takes the stage as its model: the same cfg, dtype, weights, new_cache and forward. No decode
    # overlap: the followers run a step when rank 0 sends its plan, so a step queued ahead on rank 0 alone
    # would have no one to pass its streams to.
    runner = ModelRunner(stage, prefill_chunk, indexer_tile, max_context, stage_timing_interval, decode_overlap=False)
    return PipelineRunner(runner, stage, name_lost_rank)


def join_launched_world(world: int, backend: str) -> mx.distributed.Group:
    group = init_group(backend)
    if group.size() != world:
        raise ValueError(f"--world {world} but the launcher started {group.size()} ranks")
    return group


def _name_lost_follower(followers: dict[int, subprocess.Popen], wait_s: float = 1.0) -> None:
    """A step that fails on rank 0 is most often a follower that died (the hop to it broke): if one exits
    within `wait_s`, report it as the rank watch would, instead of the step's transport error."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for rank, proc in followers.items():
            code = proc.poll()
            if code is not None:
                _rank_lost(rank, code, followers)
        time.sleep(0.05)


def _rank_lost(rank: int, code: int, followers: dict[int, subprocess.Popen]) -> None:
    logger.critical("rank %d exited (code %d): its layers are gone, so the server cannot continue; exiting", rank, code)
    stop_processes([p for r, p in followers.items() if r != rank], grace_s=0)
    sys.stderr.flush()
    os._exit(RANK_LOST_EXIT_CODE)


def _shut_down(runner: PipelineRunner, watch: RankWatch | None, followers: dict[int, subprocess.Popen]) -> None:
    if watch is not None:
        watch.expect_exit()
    try:
        runner.stop()
    except RuntimeError as exc:  # a rank already gone: nothing to tell
        logger.warning("could not tell the followers to stop: %s", exc)
    stop_processes(list(followers.values()), grace_s=_STOP_GRACE_S)
    logger.info("all ranks stopped")
