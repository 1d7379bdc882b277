"""Replay a token sequence through the model the way a server runs it — prefill in chunks of C
(indexer tiles of T), then single-token decode steps — keeping every logit row and, on request,
the indexer's selections. The checks (`check reference`, `check consistency`) and the tests compare
such runs with each other and with transformers."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tessera.engine.model.cache import resume_state
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment
from tessera.engine.serving.prefix_blocks import aligned_chunk_end
from tessera.engine.serving.prefix_cache import Lineage, PrefixCache
from tessera.engine.model.trace import ForwardTrace


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


@dataclass(frozen=True)
class CachedRun:
    logits: np.ndarray  # [len(tokens) - num_cached, vocab]: the rows this run computed
    num_cached: int  # leading tokens restored from the prefix cache


def run_with_prefix_cache(
    model: DeepseekV4, prefix_cache: PrefixCache, tokens: list[int], num_prefill: int, chunk: int, tile: int | None
) -> CachedRun:
    """`run_sequence` through a prefix cache, as the server runs it: restore the longest cached prefix
    of the prompt, prefill the rest in chunks that end on blocks (saving each such end), decode (the
    last block boundary reached is saved at the end)."""
    prompt = tokens[:num_prefill]
    node = prefix_cache.longest_prefix(prompt)
    cache = prefix_cache.restore(node, prompt) if node else model.new_cache()
    lineage, rows = Lineage(node=node), []
    for lo, hi in block_chunks(cache.num_tokens, num_prefill, chunk, prefix_cache.block_tokens):
        rows.append(_host(model.forward([Segment(cache, prompt[lo:hi])], tile=tile, all_logits=True)[0]))
        if hi % prefix_cache.block_tokens == 0:
            prefix_cache.save(cache, lineage)
    for token in tokens[num_prefill:]:
        rows.append(_host(model.forward([Segment(cache, [token])])[0]))
        if cache.num_tokens % prefix_cache.block_tokens == 0:
            lineage.pending = resume_state(cache)
    if lineage.pending is not None:
        prefix_cache.save(cache, lineage, lineage.pending)
    return CachedRun(np.concatenate(rows), node.num_tokens if node else 0)


def block_chunks(start: int, end: int, chunk: int, block: int) -> list[tuple[int, int]]:
    """Prefill spans [lo, hi) of at most `chunk` tokens from start to end, each ending on a block
    boundary when it can (a chunk shorter than a block ends where it must), and one ending at the
    prompt's last block boundary."""
    spans, lo = [], start
    while lo < end:
        hi = min(lo + chunk, end)
        hi = aligned_chunk_end(lo, hi, end, block)
        spans.append((lo, hi))
        lo = hi
    return spans
