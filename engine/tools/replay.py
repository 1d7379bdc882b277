"""Replay a token sequence through the model the way a server runs it — prefill in chunks of C
(indexer tiles of T), then single-token decode steps — keeping every logit row and, on request,
the indexer's selections. The checks (`check reference`, `check consistency`) and the tests compare
such runs with each other and with transformers."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.model.deepseek_v4 import DeepseekV4, Segment
from engine.model.trace import ForwardTrace


@dataclass(frozen=True)
class Run:
    logits: np.ndarray  # [len(tokens), vocab] float32: prefill rows, then one row per decode step
    selections: dict[tuple[int, int], tuple[int, ...]]  # (layer, position) -> selected rows


def random_tokens(vocab_size: int, count: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, count).tolist()


def run_sequence(model: DeepseekV4, tokens: list[int], num_prefill: int, chunk: int, tile: int | None) -> Run:
    """Prefill tokens[:num_prefill] in chunks (tile None: untiled), decode the rest one by one."""
    cache, trace, rows = model.new_cache(), ForwardTrace(record_selections=True), []
    for lo in range(0, num_prefill, chunk):
        piece = tokens[lo : min(lo + chunk, num_prefill)]
        rows.append(_host(model.forward([Segment(cache, piece)], tile=tile, all_logits=True, timer=trace)[0]))
    for token in tokens[num_prefill:]:
        rows.append(_host(model.forward([Segment(cache, [token])], timer=trace)[0]))
    return Run(np.concatenate(rows), trace.selections)


def _host(logits: mx.array) -> np.ndarray:
    return np.array(logits.astype(mx.float32))  # numpy has no bfloat16
