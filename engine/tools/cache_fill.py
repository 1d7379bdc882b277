"""A sequence cache at N tokens without running a prefill: every part a prefill in chunks of C leaves
(window rows, compressed rows, index keys, both compressors' frontiers, the row buffers' spare
capacity) with its exact shape and dtype, filled with random rows. `tessera bench decode --cache-fill
random` uses it to measure decode at ctx 1,048,576 in seconds instead of a prefill's minutes.

Why the contents do not change a decode step's time: every array a step reads or writes has a size
set by the token count alone — the window (sliding_window - 1 rows), every index key of a CSA layer
(scored in full), every compressed row of an HCA layer, and in a CSA layer exactly `index_topk`
selected rows whatever the scores are (the top-k always returns k rows once N ≥ k). The routed
experts a token picks depend on the hidden state, not on the cache; the step's shapes, hence its
kernels and bytes moved, are those of a real cache of N tokens. Values are N(0, 1), the magnitude of
normed rows, so the softmaxes see ordinary logits (no overflow, no all-equal scores).
"""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx

from tessera.engine.model.cache import CompressorFrontier, RowBuffer, SequenceCache
from tessera.engine.model.config import CSA, WINDOW, ModelConfig
from tessera.engine.model.memory_plan import simulated_capacity
from tessera.engine.tools.replay import random_tokens


def fill_random(cache: SequenceCache, cfg: ModelConfig, ctx: int, layers: Iterable[int], chunk: int,
                seed: int = 0) -> SequenceCache:
    """Make `cache` (empty, new) hold `ctx` tokens in `layers` (a pipeline stage's, or all): shapes and
    capacities as after a prefill in chunks of `chunk`, random values. Returns the cache."""
    if cache.num_tokens:
        raise ValueError("fill_random needs a new cache (it already holds tokens)")
    key = mx.random.key(seed)
    for i in layers:
        key, sub = mx.random.split(key)
        _fill_layer(cache, cfg, i, ctx, chunk, sub)
        mx.eval(cache.layers[i].arrays())
    cache.num_tokens = ctx
    cache.token_ids = random_tokens(cfg.vocab_size, ctx, seed=seed)
    return cache


def _fill_layer(cache: SequenceCache, cfg: ModelConfig, i: int, ctx: int, chunk: int, key: mx.array) -> None:
    layer, kind, hd = cache.layers[i], cfg.layer_types[i], cfg.head_dim
    dtype = layer.window.dtype
    keys = iter(mx.random.split(key, 8))
    layer.window = _rows(min(ctx, cfg.sliding_window - 1), hd, dtype, next(keys))
    if kind == WINDOW:
        return
    ratio = cfg.compress_ratio(i)
    overlapping = cfg.is_overlapping(i)
    layer.compressed = _buffer(ctx, chunk, ratio, hd, dtype, next(keys))
    layer.compressor = _frontier(ctx, ratio, hd, 2 * hd if overlapping else hd, overlapping, dtype, next(keys))
    if kind == CSA:
        idx = cfg.index_head_dim
        layer.index_keys = _buffer(ctx, chunk, ratio, idx, dtype, next(keys))
        layer.indexer_compressor = _frontier(ctx, ratio, idx, 2 * idx, True, dtype, next(keys))


def _rows(n: int, width: int, dtype: mx.Dtype, key: mx.array) -> mx.array:
    return mx.random.normal((n, width), key=key).astype(dtype)


def _buffer(ctx: int, chunk: int, ratio: int, width: int, dtype: mx.Dtype, key: mx.array) -> RowBuffer:
    rows = ctx // ratio
    return RowBuffer.holding(_rows(rows, width, dtype, key), simulated_capacity(ctx, chunk, ratio) if rows else 0)


def _frontier(ctx: int, ratio: int, head_dim: int, width: int, overlapping: bool, dtype: mx.Dtype,
              key: mx.array) -> CompressorFrontier:
    """The open group (ctx % ratio projected rows) and, once a window closed, the overlap half."""
    k = mx.random.split(key, 4)
    open_rows = ctx % ratio
    overlap = (None, None)
    if overlapping and ctx >= ratio:
        overlap = _rows(ratio, head_dim, dtype, k[2]), _rows(ratio, head_dim, dtype, k[3])
    return CompressorFrontier.holding(_rows(open_rows, width, dtype, k[0]), _rows(open_rows, width, dtype, k[1]),
                                      *overlap, num_emitted=ctx // ratio, ratio=ratio)
