"""Decode warm-up at start-up: one decode step at every batch size the server may run, before the first request.

With TESSERA_COMPILE_STEP on (engine/model/compiled.py), a decode step's shape-stable parts are compiled
with fixed shapes, one trace per decode batch size B. The first compiled step of a process took 61 s on
the H200 (tracing, and compiling every fused kernel), and each new batch size traces again: without a
warm-up, the server's first requests would wait for that. Like vLLM's CUDA-graph capture over batch
sizes, `warm_up_decode` pays it up front on scratch caches that are dropped afterwards, so the model's
only lasting change is its traces (the outputs of later steps do not depend on them:
tests/equivalence/test_step_compiled.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment

# Any valid id: the traces depend on shapes, not on which token runs.
_WARM_UP_TOKEN = 0


@dataclass(frozen=True)
class DecodeWarmUp:
    seconds: tuple[tuple[int, float], ...]  # (batch size, seconds of its step), in the order run
    total_seconds: float

    def describe(self) -> str:
        sizes = ", ".join(f"B={b}: {s:.2f} s" for b, s in self.seconds)
        return f"decode warm-up took {self.total_seconds:.2f} s ({sizes})"


def warm_up_decode(model: DeepseekV4, batch_sizes: Sequence[int]) -> DecodeWarmUp:
    """Runs one decode step of B sequences together for every B in `batch_sizes`, so the compiled step
    parts are traced for those batch sizes now."""
    start = time.perf_counter()
    seconds = tuple((b, _timed_decode_step(model, b)) for b in batch_sizes)
    return DecodeWarmUp(seconds, time.perf_counter() - start)


def _timed_decode_step(model: DeepseekV4, batch_size: int) -> float:
    """One step of `batch_size` one-token segments on fresh scratch caches: a decode step's shapes (one row
    per sequence; the compiled parts' shapes depend on nothing else), one step per batch size, so the
    warm-up costs max_num_seqs steps, not a prefill per sequence on top."""
    start = time.perf_counter()
    caches = [model.new_cache() for _ in range(batch_size)]
    mx.eval(model.forward([Segment(cache, [_WARM_UP_TOKEN]) for cache in caches]))
    return time.perf_counter() - start
