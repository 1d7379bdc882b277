"""V4 attention for one layer over a batch of segments (one segment = some tokens of one sequence).

The narrow projections (q's low-rank residual, K = V, index head weights) run on every token of
the step at once; the compressor, the indexer and the mixed attention run per segment, the last two
in tiles of `tile` query rows (docs/ARCHITECTURE.md, "Tiling invariants"): compress first, then per tile score → top-k → gather
window ∪ selected rows → attend. The wide per-head queries and the output projection run in fixed
blocks of PROJECTION_ROWS rows as the tiles reach them, so no [chunk, heads, head_dim] tensor exists.
Decode rows (segments of one token) skip the per-segment loop: they run together, one batched call
per layer (engine/model/decode_attention.py), with the shapes a one-row tile would give them.

Every product whose per-row result could depend on how many rows it is computed with runs on a
shape fixed by the row's position, never by the tile: projections in PROJECTION_ROWS blocks of the
batch, attention in ATTENTION_ROWS blocks of the segment (`attention_blocks`). On a GPU, cuBLAS picks
its algorithm (tile shape, split-K / stream-K reduction order) from the whole problem — batch count
and rows included — so the same row computed in a 197-row and in a 3001-row batch can differ in the
last bits (docs/BENCHMARKS.md, "Issue 12"). The indexer kernels are per row by construction.
Whether a quantized projection runs dense or quantized (engine/model/quantized.py, dense_min_rows)
is likewise decided once by the batch's rows (`_for_batch`), never by a tile's or a block's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from tessera.engine.model.attention_inputs import AttentionWeights, SegmentSlice
from tessera.engine.model.cache import owned
from tessera.engine.model.compiled import StepCompiled
from tessera.engine.model.compressor import compress
from tessera.engine.model.config import CSA, HCA, WINDOW, ModelConfig
from tessera.engine.model.decode_attention import DecodeRows, decode_attention
from tessera.engine.model.norms import rms_norm, unweighted_rms_norm
from tessera.engine.model.quantized import dense_min_rows, for_rows, grouped_linear, linear, prime_grouped_linear
from tessera.engine.model.rope import RopeTables, StepRope, apply_rope
from tessera.engine.model.trace import ForwardTrace
from tessera.kernels.indexer import indexer_scores, select_topk
from tessera.kernels.sparse_attention import mixed_attention, shared_rows
from tessera.kernels.switch import Switch


# Query and output projections run on fixed blocks of this many rows of the step's batch, counted
# from its first row. A gemm's row comes out differently in the last bits depending on the matrix
# height (OpenBLAS; a GPU gemm's tile choice), so fixed blocks make a row's queries and attention
# output independent of the indexer tile — and keep the chunk-wide [C, heads, head_dim] queries and
# attention output, the largest chunk-scaled activations, out of memory (one block at a time).
PROJECTION_ROWS = 256

# Mixed attention runs on blocks of this many query rows of a segment, counted from its first row and
# cut at its end; a tile that covers only part of a block fills the rest with padding rows (zero
# queries, no visible rows) so the batched products keep the block's shape. The row's position in
# the block and the block's shape then depend only on the row and the segment length — not on the
# tile — which is what makes the GPU's batched gemms give the same bits tiled and untiled. A tile
# that is a multiple of ATTENTION_ROWS pads nothing (except at the segment's end, the same block
# either way); other tiles pay for at most two padded blocks each.
ATTENTION_ROWS = 128


# Decode rows (segments of one token) attend as one batch per layer (engine/model/decode_attention.py).
# False sends each through the per-segment tile path as a one-row tile — the same bits on a
# row-invariant BLAS (tests/equivalence/test_batched_decode.py); kept for A/B measurements
# (docs/bench/issue14_batched_decode.py).
BATCH_DECODE_ROWS = True

# A decode step computes its input projections (q_a, kv, index head weights, the compressors' kv and gate)
# as few stacked matmuls (attention_inputs.StackedInputs). TESSERA_STACKED_INPUTS=0 runs one matmul per
# projection instead: the same bits on the CPU (a row's sums do not depend on the other output rows,
# tests/equivalence/test_stacked_inputs.py); kept for A/B measurements on a GPU.
_stacked_inputs = Switch("TESSERA_STACKED_INPUTS")


def stacked_inputs_enabled() -> bool:
    return _stacked_inputs.enabled()


def set_stacked_inputs_enabled(enabled: bool) -> None:
    """Takes effect on the next step built."""
    _stacked_inputs.set(enabled)


@dataclass(frozen=True)
class _ChunkProjections:
    """What the step's whole batch projects at once: small per token."""

    q_residual: mx.array  # [T, q_lora]
    kv: mx.array  # [T, hd] (K = V)
    index_w: mx.array | None  # [T, IH]
    compressor_in: tuple[mx.array, mx.array] | None = None  # the compressor's kv, gate [T, width] (stacked inputs)
    index_compressor_in: tuple[mx.array, mx.array] | None = None  # the indexer compressor's, likewise


def attention(
    x: mx.array,
    rope: StepRope,
    segments: list[SegmentSlice],
    w: AttentionWeights,
    cfg: ModelConfig,
    layer: int,
    tile: int,
    timer: ForwardTrace,
    compiled: DecodeProjections | None = None,
) -> mx.array:
    """x: [T, D] (normed block input), rope: the step's RoPE tables (its positions [T]) -> [T, D].
    compiled: this layer's decode projections compiled (`DecodeProjections`), for a step whose every segment
    is one token, in batch order (the model's step layout); the other steps build them here."""
    spec = cfg.rope_for(layer)
    tables = rope.tables(spec, cfg.head_dim)
    index_tables = rope.tables(spec, cfg.index_head_dim) if cfg.has_indexer(layer) else None  # the compress table
    if compiled is not None and BATCH_DECODE_ROWS:
        kv, index_w, compressor_in, index_compressor_in, q, index_q = compiled.inputs(x, tables, index_tables)
        rows = DecodeRows(segments, x, kv, q, index_q, index_w, compressor_in, index_compressor_in)
        decoded = timer.stage("attention", decode_attention(rows, w, cfg, layer, timer))  # [B, H, hd]
        return compiled.output(decoded, rope.tables(spec, cfg.head_dim, inverse=True))
    w = _for_batch(w, x.shape[0], x.dtype)
    decode_step = all(seg.length == 1 for seg in segments)
    use_stacked = decode_step and _takes_stacked_inputs(w)
    chunk = _project_chunk(x, tables, w, cfg, layer, w.stacked_inputs.project(x) if use_stacked else None)
    queries = _QueryBlocks(chunk.q_residual, tables, index_tables, w, cfg, layer)
    output = _OutputBlocks(rope.tables(spec, cfg.head_dim, inverse=True), w, cfg)
    decodes = [seg for seg in segments if seg.length == 1] if BATCH_DECODE_ROWS else []
    decoded = None
    if decodes:
        decoded = timer.stage("attention", decode_attention(_decode_rows(x, chunk, queries, decodes), w, cfg, layer, timer))
    done = pending = 0  # decode rows handed to `output` so far; batched rows waiting to go with them
    for seg in segments:
        if decoded is not None and seg.length == 1:  # batched above; its row goes out in batch order
            pending += 1
            continue
        if pending:
            output.add(_rows(decoded, done, done + pending))
            done, pending = done + pending, 0
        _segment_attention(x, chunk, queries, output, seg, w, cfg, layer, tile, timer)
    if pending:  # a run of decode rows goes out as one piece (all of them in a decode step: no slice)
        output.add(_rows(decoded, done, done + pending))
    return output.result()


class DecodeProjections:
    """A layer's projections around a decode step's attention, compiled with fixed shapes (compiled.StepCompiled):
    before it, the input projections, their norms and the rotations of q, K = V and the index queries
    (`_decode_inputs`); after it, the rotation back and the output projection (`_decode_output`). A decode step's
    shapes there are its batch size alone, so each traces once per size and replays from C++ after that: no
    Python builds them in every step (an H100's batch-1 step at 16k: build 1.3 -> 1.0 ms, measured on this class's
    first form: docs/BENCHMARKS.md, "Sessions 25 and 26 on H100s"). The same functions as the plain path, so compiled and plain give the same bits (tests/equivalence/test_step_compiled.py).
    The cache-dependent rest (compressors, indexer, top-k, mixed attention) stays in Python."""

    def __init__(self, w: AttentionWeights, cfg: ModelConfig, layer: int) -> None:
        self._w, self._cfg, self._layer = w, cfg, layer
        self._rotated = cfg.rope_for(layer).dim // 2
        # One trace set per stacked-inputs setting: it decides which projections exist (the compressors' inputs).
        self._inputs = {stacked: StepCompiled(lambda *a, stacked=stacked: self._named_inputs(stacked, *a)) for stacked in (True, False)}
        self._output = StepCompiled(self._flat_output, prime=lambda: prime_grouped_linear(w.wo_a, cfg.o_groups))

    @property
    def traces(self) -> tuple[int, int]:
        """How often the inputs' and the output's functions were traced (StepCompiled.traces)."""
        return sum(c.traces for c in self._inputs.values()), self._output.traces

    def inputs(self, x: mx.array, tables: RopeTables, index_tables: RopeTables | None):
        """x [B, D] -> (kv, index_w, compressor_in, index_compressor_in, q, index_q) as `_decode_inputs`."""
        index = () if index_tables is None else (index_tables.cos, index_tables.signed_sin)
        out = self._inputs[_takes_stacked_inputs(self._w)](x, tables.cos, tables.signed_sin, *index)
        return (out["kv"], out.get("index_w"), _pair(out, "compressor"), _pair(out, "index_compressor"), out["q"],
                out.get("index_q"))

    def output(self, decoded: mx.array, inverse: RopeTables) -> mx.array:
        """decoded [B, H, hd] -> [B, D] as `_decode_output`."""
        return self._output(decoded, inverse.cos, inverse.signed_sin)

    def _named_inputs(self, stacked: bool, x: mx.array, cos: mx.array, signed_sin: mx.array, *index: mx.array) -> dict[str, mx.array]:
        """`_decode_inputs` as a compiled function returns them: by name, the parts the layer lacks left out."""
        index_tables = RopeTables(*index, self._rotated) if index else None
        kv, index_w, compressor_in, index_compressor_in, q, index_q = _decode_inputs(
            x, RopeTables(cos, signed_sin, self._rotated), index_tables, self._w, self._cfg, self._layer, stacked)
        named = {"kv": kv, "index_w": index_w, "q": q, "index_q": index_q}
        for prefix, pair in (("compressor", compressor_in), ("index_compressor", index_compressor_in)):
            if pair is not None:
                named[f"{prefix}_kv"], named[f"{prefix}_gate"] = pair
        return {name: a for name, a in named.items() if a is not None}

    def _flat_output(self, decoded: mx.array, cos: mx.array, signed_sin: mx.array) -> mx.array:
        return _decode_output(decoded, RopeTables(cos, signed_sin, self._rotated), self._w, self._cfg)


def _pair(named: dict[str, mx.array], prefix: str) -> tuple[mx.array, mx.array] | None:
    """A compressor's (kv, gate) input pair from `DecodeProjections._named_inputs`' outputs, if the layer has it."""
    return (named[f"{prefix}_kv"], named[f"{prefix}_gate"]) if f"{prefix}_kv" in named else None


def _takes_stacked_inputs(w: AttentionWeights) -> bool:
    """Whether a decode step projects the layer's inputs through its stacked weight (attention_inputs.py)."""
    return w.stacked_inputs is not None and stacked_inputs_enabled()


def _decode_inputs(x: mx.array, tables: RopeTables, index_tables: RopeTables | None, w: AttentionWeights, cfg: ModelConfig,
                   layer: int, stacked: bool):
    """A decode step's rows x [B, D] -> kv [B, hd], index_w [B, IH], the compressors' inputs (kv, gate pairs, with
    stacked inputs), q [B, H, hd], index_q [B, IH, ID] (None where the layer has no such part): what `attention`
    builds for them, in one function."""
    w = _for_batch(w, x.shape[0], x.dtype)
    chunk = _project_chunk(x, tables, w, cfg, layer, w.stacked_inputs.project(x) if stacked else None)
    q, index_q = _QueryBlocks(chunk.q_residual, tables, index_tables, w, cfg, layer).rows(0, x.shape[0])
    return chunk.kv, chunk.index_w, chunk.compressor_in, chunk.index_compressor_in, q, index_q


def _decode_output(decoded: mx.array, inverse: RopeTables, w: AttentionWeights, cfg: ModelConfig) -> mx.array:
    """decoded [B, H, hd] -> [B, D]: `_OutputBlocks` of one block."""
    return _rotated_back_output(decoded, inverse, _for_batch(w, decoded.shape[0], decoded.dtype), cfg)


def _decode_rows(x: mx.array, chunk: _ChunkProjections, queries: _QueryBlocks, decodes: list[SegmentSlice]) -> DecodeRows:
    """The decode segments' rows of the step's batch (usually rows [0, B): the runner puts decodes first)."""
    offsets = [seg.offset for seg in decodes]
    first = offsets[0]
    if offsets == list(range(first, first + len(offsets))):
        take = lambda a: None if a is None else _rows(a, first, first + len(offsets))  # noqa: E731
        q, index_q = queries.rows(first, first + len(offsets))
    else:
        index = mx.array(offsets)
        take = lambda a: None if a is None else a[index]  # noqa: E731
        per_row = [queries.rows(r, r + 1) for r in offsets]
        q = mx.concatenate([p[0] for p in per_row])
        index_q = None if per_row[0][1] is None else mx.concatenate([p[1] for p in per_row])
    pair = lambda p: None if p is None else (take(p[0]), take(p[1]))  # noqa: E731
    return DecodeRows(decodes, take(x), take(chunk.kv), q, index_q, take(chunk.index_w),
                      pair(chunk.compressor_in), pair(chunk.index_compressor_in))


def _for_batch(w: AttentionWeights, rows: int, dtype: mx.Dtype) -> AttentionWeights:
    """The block-projected weights in the form the whole batch uses (quantized.for_rows by its rows):
    a large batch dequantizes each once and its PROJECTION_ROWS blocks share the copy, and every
    row takes the same path however the batch is tiled. Below dense_min_rows() (decode) for_rows keeps
    every weight as it is: `w` itself, with no per-layer copy of the weights record."""
    if rows < dense_min_rows():
        return w
    return replace(
        w, wq_b=for_rows(w.wq_b, rows, dtype), wo_a=for_rows(w.wo_a, rows, dtype), wo_b=for_rows(w.wo_b, rows, dtype),
        index_wq_b=None if w.index_wq_b is None else for_rows(w.index_wq_b, rows, dtype),
    )


def _project_chunk(
    x: mx.array, tables: RopeTables, w: AttentionWeights, cfg: ModelConfig, layer: int,
    projected: dict[str, mx.array] | None = None,
) -> _ChunkProjections:
    """`projected`: the input projections already computed (StackedInputs.project), else one matmul each here."""
    eps = cfg.rms_norm_eps

    def project(name: str, weight) -> mx.array:
        return projected[name] if projected is not None else linear(x, weight)

    q_residual = rms_norm(project("wq_a", w.wq_a), w.q_norm, eps)  # [T, q_lora]
    kv = apply_rope(rms_norm(project("wkv", w.wkv), w.kv_norm, eps), tables)  # [T, hd]
    index_w = None
    if cfg.has_indexer(layer):
        index_w = project("index_weights_proj", w.index_weights_proj) * (cfg.index_n_heads**-0.5)  # [T, IH]
    compressors = [None, None]
    if projected is not None:
        for i, name in enumerate(("compressor", "index_compressor")):
            if name + ".wkv" in projected:
                compressors[i] = (projected[name + ".wkv"], projected[name + ".wgate"])
    return _ChunkProjections(q_residual, kv, index_w, *compressors)


class _QueryBlocks:
    """Queries (and index queries) of the batch's rows, projected one PROJECTION_ROWS block at a
    time; the last block is kept because consecutive tiles may share it."""

    def __init__(
        self, q_residual: mx.array, tables: RopeTables, index_tables: RopeTables | None, w: AttentionWeights,
        cfg: ModelConfig, layer: int,
    ) -> None:
        """index_tables: the index queries' (None without an indexer)."""
        self._q_residual, self._tables, self._index_tables = q_residual, tables, index_tables
        self._w, self._cfg, self._indexed = w, cfg, index_tables is not None
        self._last: tuple[int, mx.array, mx.array | None] | None = None

    def rows(self, r0: int, r1: int) -> tuple[mx.array, mx.array | None]:
        """Batch rows [r0, r1) -> q [t, H, hd], index_q [t, IH, ID] (None without an indexer)."""
        first, last = r0 // PROJECTION_ROWS, (r1 - 1) // PROJECTION_ROWS
        blocks = [self._block(j) for j in range(first, last + 1)]
        lo, hi = r0 - first * PROJECTION_ROWS, r1 - first * PROJECTION_ROWS
        q = _rows(_joined([b[0] for b in blocks]), lo, hi)
        index_q = _rows(_joined([b[1] for b in blocks]), lo, hi) if self._indexed else None
        return q, index_q

    def _block(self, j: int) -> tuple[mx.array, mx.array | None]:
        if self._last is not None and self._last[0] == j:
            return self._last[1], self._last[2]
        cfg, w, eps = self._cfg, self._w, self._cfg.rms_norm_eps
        r0, r1 = j * PROJECTION_ROWS, min((j + 1) * PROJECTION_ROWS, self._q_residual.shape[0])
        q_residual = _rows(self._q_residual, r0, r1)
        q = linear(q_residual, w.wq_b).reshape(r1 - r0, cfg.num_attention_heads, cfg.head_dim)
        q = apply_rope(unweighted_rms_norm(q, eps), self._tables.rows(r0, r1))  # [B, H, hd]
        index_q = None
        if self._indexed:
            index_q = linear(q_residual, w.index_wq_b).reshape(r1 - r0, cfg.index_n_heads, cfg.index_head_dim)
            index_q = apply_rope(index_q, self._index_tables.rows(r0, r1))  # CSA: the compress table, as the keys
        self._last = (j, q, index_q)
        return q, index_q


class _OutputBlocks:
    """Collects the tiles' attention outputs in batch order and projects each completed
    PROJECTION_ROWS block to the model width, so at most a block plus a tile of [rows, H, hd]
    outputs wait at a time."""

    def __init__(self, inverse: RopeTables, w: AttentionWeights, cfg: ModelConfig) -> None:
        """inverse: the step's rotation back (K = V carried RoPE into the output)."""
        self._inverse, self._w, self._cfg = inverse, w, cfg
        self._pending: list[mx.array] = []  # [r, H, hd] pieces, in batch order
        self._pending_rows = 0
        self._projected: list[mx.array] = []  # [B, D] blocks

    def add(self, out: mx.array) -> list[mx.array]:
        """Queues a tile's [t, H, hd] output; returns the blocks it completed (projected, lazy)."""
        self._pending.append(out)
        self._pending_rows += out.shape[0]
        done = []
        while self._pending_rows >= PROJECTION_ROWS:
            done.append(self._project(self._take(PROJECTION_ROWS)))
        return done

    def result(self) -> mx.array:
        """-> [T, D] for the whole batch (projects the final, shorter block)."""
        if self._pending_rows:
            self._project(self._take(self._pending_rows))
        return _joined(self._projected)

    def _take(self, num_rows: int) -> mx.array:
        parts, got = [], 0
        while got < num_rows:
            piece, need = self._pending[0], num_rows - got
            if piece.shape[0] <= need:
                parts.append(self._pending.pop(0))
            else:
                parts.append(piece[:need])
                self._pending[0] = piece[need:]
            got += parts[-1].shape[0]
        self._pending_rows -= num_rows
        return _joined(parts)

    def _project(self, out: mx.array) -> mx.array:
        r0 = len(self._projected) * PROJECTION_ROWS
        r1 = r0 + out.shape[0]
        block = _rotated_back_output(out, self._inverse.rows(r0, r1), self._w, self._cfg)  # [B, D]
        self._projected.append(block)
        return block


def _joined(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def _rows(a: mx.array, r0: int, r1: int) -> mx.array:
    """a[r0:r1], without a slice node when that is all of `a` (a decode step's batch, one block)."""
    return a if r0 == 0 and r1 == a.shape[0] else a[r0:r1]


def _rotated_back_output(out: mx.array, inverse: RopeTables, w: AttentionWeights, cfg: ModelConfig) -> mx.array:
    """[B, H, hd] -> [B, D]. K = V carried RoPE into the output's rope slice: rotated back by the query positions
    (`inverse`); then a per-group low-rank projection and one mixing projection."""
    out = apply_rope(out, inverse)
    num_tokens, groups = out.shape[0], cfg.o_groups
    if num_tokens == 1:  # [1, G, ·] and [G, 1, ·] are one order in memory: a reshape each way, no transpose node
        grouped = out.reshape(groups, 1, -1)  # [G, 1, H·hd / G]
        return linear(grouped_linear(grouped, w.wo_a, groups).reshape(1, -1), w.wo_b)
    grouped = out.reshape(num_tokens, groups, -1).transpose(1, 0, 2)  # [G, B, H·hd / G]
    mid = grouped_linear(grouped, w.wo_a, groups).transpose(1, 0, 2).reshape(num_tokens, -1)  # [B, G·o_lora]
    return linear(mid, w.wo_b)


def _segment_attention(
    x: mx.array,
    chunk: _ChunkProjections,
    queries: _QueryBlocks,
    output: _OutputBlocks,
    seg: SegmentSlice,
    w: AttentionWeights,
    cfg: ModelConfig,
    layer: int,
    tile: int,
    timer: ForwardTrace,
) -> None:
    """Attention of one segment's queries, tile by tile into `output`; appends to its layer cache."""
    lo, hi = seg.offset, seg.offset + seg.length
    cache, kind = seg.cache, cfg.layer_types[layer]
    # Invariant 1: every row completed inside the segment exists before any tile is scored.
    if kind in (CSA, HCA):
        _emit_compressed(x[lo:hi], seg, w, cfg, layer)
    keys = mx.concatenate([cache.window, chunk.kv[lo:hi]])  # [Wp + L, hd]
    num_prev = cache.window.shape[0]
    keep = cfg.sliding_window - 1
    cache.window = owned(keys[max(keys.shape[0] - keep, 0) :] if keep > 0 else keys[:0])
    # Evaluating the cache's new state now lets the chunk-wide arrays it was cut from go before the
    # tile loop, instead of at the end of the forward pass. A decode segment's arrays are a few rows:
    # evaluating them here would only add a host round trip per sequence and layer.
    if seg.length > 1:
        timer.boundary("other", keys, *cache.arrays())
    else:
        timer.stage("other", keys, *cache.arrays())
    context = _TileContext(seg, keys, num_prev, w, cfg, layer, timer)
    running: list[mx.array] = []  # the tile the device is computing while Python builds the next
    for r0 in range(0, seg.length, tile):
        r1 = min(r0 + tile, seg.length)
        q, index_q = queries.rows(lo + r0, lo + r1)
        timer.stage("other", q, *([] if index_q is None else [index_q]))
        index_w = None if chunk.index_w is None else chunk.index_w[lo + r0 : lo + r1]
        out = _tile_attention(context, q, index_q, index_w, r0, r1)
        built = [out, *output.add(out)]
        if seg.length > 1 and timer.pipelines_tiles:
            # Tile i+1's graph was built while tile i ran; wait for tile i, then start i+1 without
            # waiting: one tile's scratch on the device at a time, no idle gap for graph building.
            _finish(running, timer)
            mx.async_eval(*built)
            running = built
        elif seg.length > 1:  # blocking tiles (stage-synced, or pipelining switched off): evaluate, then build the next
            timer.boundary("attention", *built)
        else:
            timer.stage("attention", *built)
    _finish(running, timer)


def _finish(running: list[mx.array], timer: ForwardTrace) -> None:
    """Waits for the tile started last (if any) and charges the wait to attention."""
    if running:
        timer.boundary("attention", *running)


def _emit_compressed(x: mx.array, seg: SegmentSlice, w: AttentionWeights, cfg: ModelConfig, layer: int) -> None:
    cache, ratio, eps = seg.cache, cfg.compress_ratio(layer), cfg.rms_norm_eps
    overlapping, rope = cfg.is_overlapping(layer), cfg.rope_for(layer)
    rows, cache.compressor = compress(x, w.compressor, cache.compressor, ratio, overlapping, rope, eps)
    cache.compressed.append(rows)
    if cfg.has_indexer(layer):
        keys, cache.indexer_compressor = compress(x, w.index_compressor, cache.indexer_compressor, ratio, overlapping, rope, eps)
        cache.index_keys.append(keys)


@dataclass(frozen=True)
class _TileContext:
    """What every tile of one segment at one layer shares."""

    seg: SegmentSlice
    keys: mx.array  # [Wp + L, hd]: the cached window rows, then this segment's K = V rows
    num_prev: int  # how many of `keys` came from the cache (Wp)
    w: AttentionWeights
    cfg: ModelConfig
    layer: int
    timer: ForwardTrace


def _tile_attention(
    ctx: _TileContext, q: mx.array, index_q: mx.array | None, index_w: mx.array | None, r0: int, r1: int
) -> mx.array:
    """Query rows [r0, r1) of the segment (q: [t, H, hd]) -> [t, H, hd]."""
    cfg, seg, keys = ctx.cfg, ctx.seg, ctx.keys
    local = mx.arange(r0, r1)  # [t]
    key_idx = window_key_indices(ctx.num_prev, r0, r1, cfg.sliding_window)  # [t, W]
    groups = [AttentionGroup(keys[mx.maximum(key_idx, 0)], key_idx >= 0)]  # window rows [t, W, hd]
    kind = cfg.layer_types[ctx.layer]
    if kind != WINDOW:
        visible = (seg.start + local + 1) // cfg.compress_ratio(ctx.layer)  # [t]: rows from tokens ≤ the query
        compressed = seg.cache.compressed.view()  # [N, hd]
        if kind == CSA:
            selected, selected_valid = _select(ctx, index_q, index_w, r0, visible)
            groups.append(AttentionGroup(compressed[selected], selected_valid))  # [t, k, hd]
        else:
            groups.append(AttentionGroup(compressed, mx.arange(compressed.shape[0])[None, :] < visible[:, None], shared=True))
    return blockwise_attention(q, groups, ctx.w.sinks, cfg.head_dim**-0.5, r0, r1, seg.length)


def window_key_indices(num_prev: int, r0: int, r1: int, window: int) -> mx.array:
    """Segment rows [r0, r1) -> [t, W] indices into keys = (cached window ‖ the segment's K): the
    query at row r sees keys[num_prev + r - window + 1 .. num_prev + r]; negative ones don't exist."""
    return num_prev + mx.arange(r0, r1)[:, None] - (window - 1) + mx.arange(window)[None, :]


@dataclass(frozen=True)
class AttentionGroup:
    """Rows a tile's queries attend to: per query row (rows [t, R, hd]) or, `shared`, the same
    [R, hd] for every query (HCA, broadcast without a copy); valid: [t, R] bool."""

    rows: mx.array
    valid: mx.array
    shared: bool = False


def attention_blocks(r0: int, r1: int, length: int, block: int = ATTENTION_ROWS) -> list[tuple[int, int, int, int]]:
    """One tile, segment rows [r0, r1) of `length` -> for every ATTENTION_ROWS block it touches
    (b0, b1, lo, hi): the block [b0, b1) (b0 a multiple of `block`, b1 cut at the segment's end) and
    the tile's rows in it, [lo, hi). The block depends on the row alone, never on the tile."""
    return [(b0, min(b0 + block, length), max(b0, r0), min(b0 + block, length, r1))
            for b0 in range(r0 // block * block, r1, block)]


def blockwise_attention(
    q: mx.array, groups: list[AttentionGroup], sinks: mx.array, scale: float, r0: int, r1: int, length: int
) -> mx.array:
    """q: [t, H, hd] of segment rows [r0, r1) -> [t, H, hd], one fixed-shape block at a time."""
    outs = []
    for b0, b1, lo, hi in attention_blocks(r0, r1, length):
        before, after, part = lo - b0, b1 - hi, slice(lo - r0, hi - r0)
        block_groups = [
            (shared_rows(g.rows, b1 - b0) if g.shared else _padded(g.rows[part], before, after),
             _padded(g.valid[part], before, after))
            for g in groups
        ]
        out = mixed_attention(_padded(q[part], before, after), block_groups, sinks, scale)  # [b1 - b0, H, hd]
        outs.append(out[before : before + hi - lo])
    return _joined(outs)


def _padded(x: mx.array, before: int, after: int) -> mx.array:
    """x: [n, ...] -> [before + n + after, ...] with zero (False) rows around it: padding rows have
    no visible rows and contribute nothing, they only keep the block's shape."""
    if before == 0 and after == 0:
        return x
    zeros = lambda n: mx.zeros((n,) + tuple(x.shape[1:]), dtype=x.dtype)  # noqa: E731
    return mx.concatenate([zeros(before), x, zeros(after)])


def _select(
    ctx: _TileContext, index_q: mx.array, index_w: mx.array, r0: int, visible: mx.array
) -> tuple[mx.array, mx.array]:
    """Indexer for one tile: [t, N] scores in one scratch, then top-k -> (rows, valid) [t, k]."""
    cfg, seg, layer, timer = ctx.cfg, ctx.seg, ctx.layer, ctx.timer
    index_keys = seg.cache.index_keys.view()  # [N, ID]
    if index_keys.shape[0] == 0:
        empty = mx.zeros((index_q.shape[0], 0), dtype=mx.int32)
        timer.record_selection(layer, seg.start + r0, empty, empty.astype(mx.bool_))
        return empty, empty.astype(mx.bool_)
    scale = cfg.index_head_dim**-0.5
    scores = indexer_scores(index_q, index_w, index_keys, visible, scale)
    scores = timer.stage("indexer_score", scores)
    selected, valid = select_topk(scores, visible, cfg.index_topk)
    timer.stage("topk", selected, valid)
    timer.record_selection(layer, seg.start + r0, selected, valid)
    return selected, valid
