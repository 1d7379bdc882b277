"""Build a ready-to-start engine from plain options: load the model, size the KV budget, wire the scheduler.

`tessera serve` calls this through server/serve.py with values taken from its Settings; keeping it here means
no server module imports MLX code (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.compiled import step_compile_enabled
from tessera.engine.model.deepseek_v4 import DeepseekV4
from tessera.engine.model.loader import load_config
from tessera.engine.model.tokenizer import Tokenizer
from tessera.engine.serving.blas import blas_in_use
from tessera.engine.serving.engine_loop import AsyncEngine
from tessera.engine.serving.runner import build_runner
from tessera.engine.serving.scheduler import SchedulerConfig
from tessera.engine.serving.warm_up import DecodeWarmUp, warm_up_decode
from tessera.engine.tools.default_model import ensure_default_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    model_dir: Path | None  # None: the embedded default model
    prefill_chunk: int
    indexer_tile: int
    max_context: int | None  # None: the model's max_position_embeddings
    stage_timing_interval: int
    max_num_seqs: int
    max_queued_requests: int
    memory_budget: int | None  # bytes for weights + workspace + KV caches; None: memory_fraction of the device
    memory_fraction: float = 0.9
    world: int = 1  # processes the layers are split over (engine/parallel/, docs/PARALLEL.md); this one is rank 0
    weights_dtype: str | None = None  # dequantize quantized weights to this dtype at load (debugging); None: quantized compute
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None  # None: DEFAULT_PREFIX_CACHE_SHARE of the cache budget, or ..._BYTES
    decode_overlap: bool = True  # queue the next decode step ahead (engine/serving/decode_overlap.py); world 1 only


@dataclass(frozen=True)
class BuiltEngine:
    engine: AsyncEngine  # not started
    tokenizer: Tokenizer
    model_dir: Path
    max_model_len: int
    memory_budget: int  # the whole budget in bytes (weights + workspace + KV caches)


def build_engine(options: EngineOptions) -> BuiltEngine:
    model_dir = Path(options.model_dir) if options.model_dir is not None else ensure_default_model()
    tokenizer = Tokenizer.from_dir(model_dir)
    max_model_len = options.max_context or load_config(model_dir).max_position_embeddings
    if mx.default_device() == mx.cpu:
        blas = blas_in_use()
        (logger.warning if blas.is_slow else logger.info)(blas.describe())
    budget = memory_budget_of(options.memory_budget, options.memory_fraction)
    shape = dict(prefill_chunk=options.prefill_chunk, indexer_tile=options.indexer_tile, max_context=max_model_len,
                 stage_timing_interval=options.stage_timing_interval)
    if options.world > 1:  # pipeline parallel: this process is rank 0 (and starts the other ranks)
        from tessera.engine.parallel.serving import build_pipeline_runner

        if options.weights_dtype is not None:
            raise ValueError("weights_dtype is not supported with world > 1 yet: the pipeline ranks load quantized")

        runner = build_pipeline_runner(model_dir, options.world, **shape)
        if options.decode_overlap:
            logger.info("decode_overlap applies to world 1: the pipeline ranks run one decode step at a time")
    else:
        runner = build_runner(model_dir, **shape, weights_dtype=options.weights_dtype,
                              decode_overlap=options.decode_overlap)
        warm_up_compiled_decode(runner.model, options.max_num_seqs)
    cache_budget = kv_cache_budget(budget, runner.memory_snapshot())
    # Pipeline ranks would each have to restore the same state: no prefix cache there yet (docs/PARALLEL.md).
    prefix_bytes = prefix_cache_bytes(options, cache_budget) if options.world == 1 else 0
    if prefix_bytes:
        runner.set_prefix_cache_bytes(prefix_bytes)
    config = SchedulerConfig(
        prefill_chunk=options.prefill_chunk,
        max_num_seqs=options.max_num_seqs,
        max_queued_requests=options.max_queued_requests,
        max_model_len=max_model_len,
        memory_budget_bytes=cache_budget,
        prefix_cache_bytes=prefix_bytes,
    )
    eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    engine = AsyncEngine(runner, config, eos_token_ids=eos_ids)
    return BuiltEngine(engine, tokenizer, model_dir, max_model_len, budget)


def warm_up_compiled_decode(model: DeepseekV4, max_num_seqs: int) -> DecodeWarmUp | None:
    """With the step compile on, traces every decode batch size the scheduler may run (1..max_num_seqs) now,
    so the first requests do not wait for it (engine/serving/warm_up.py); None when it is off (nothing to trace)."""
    if not step_compile_enabled():
        return None
    # Said before, not only after: on a fresh GPU machine this compiles MLX's kernels, minutes of silence.
    logger.info("decode warm-up: one step at each batch size 1..%d (the first compiles the kernels: up to a few "
                "minutes on a fresh machine; TESSERA_COMPILE_STEP=0 skips it)", max_num_seqs)
    warm_up = warm_up_decode(model, range(1, max_num_seqs + 1))
    logger.info(warm_up.describe())
    return warm_up


def memory_budget_of(memory_budget: int | None, memory_fraction: float) -> int:
    """The explicit budget, else `memory_fraction` of the device's memory (as vLLM's gpu_memory_utilization)."""
    if memory_budget is not None:
        return memory_budget
    total, where = device_memory_bytes()
    budget = int(total * memory_fraction)
    logger.info("memory budget: %.1f GiB = %.0f %% of %s (%.1f GiB); set --memory-budget or --memory-fraction "
                "to change it", budget / 2**30, memory_fraction * 100, where, total / 2**30)
    return budget


def device_memory_bytes() -> tuple[int, str]:
    """(bytes, what they are): the memory MLX reports for its GPU (unified memory on Apple silicon), else this
    machine's physical RAM (the CPU backend keeps everything there)."""
    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    for key in ("memory_size", "total_memory"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return info[key], f"the GPU's memory ({key})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's RAM"


DEFAULT_PREFIX_CACHE_SHARE = 4  # 1/4 of the caches' budget
DEFAULT_PREFIX_CACHE_BYTES = 4 * 2**30  # without a budget


def prefix_cache_bytes(options: EngineOptions, cache_budget: int | None) -> int:
    """The prefix cache's bytes (0: off), checked against the caches' budget it is taken from."""
    if not options.prefix_cache:
        return 0
    if options.prefix_cache_bytes is None:
        return DEFAULT_PREFIX_CACHE_BYTES if cache_budget is None else cache_budget // DEFAULT_PREFIX_CACHE_SHARE
    if cache_budget is not None and options.prefix_cache_bytes >= cache_budget:
        raise ValueError(
            f"prefix_cache_bytes ({options.prefix_cache_bytes} bytes) must be less than what memory_budget leaves "
            f"for caches after weights and workspace ({cache_budget} bytes): lower --prefix-cache-bytes or raise "
            "--memory-budget"
        )
    return options.prefix_cache_bytes


def kv_cache_budget(memory_budget: int | None, memory: dict[str, int]) -> int | None:
    """The scheduler admits against KV caches only: the budget less weights and the planned workspace."""
    if memory_budget is None:
        return None
    fixed = memory.get("weights", 0) + memory.get("planned_workspace", 0)
    if fixed >= memory_budget:
        raise ValueError(
            f"memory_budget ({memory_budget} bytes) does not cover weights + planned prefill workspace "
            f"({fixed} bytes), leaving nothing for KV caches: raise --memory-budget or lower --prefill-chunk"
        )
    return memory_budget - fixed
