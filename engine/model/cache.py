"""Per-sequence, per-layer cache: window rows, compressed rows, index keys and the
compressor frontier. The model declares the layout (`SequenceCache.for_model`); accounting of bytes
lives here too, so the memory plan and the scheduler read one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx

from tessera.engine.model.config import CSA, ModelConfig, WINDOW


def owned(rows: mx.array) -> mx.array:
    """A copy of `rows` with a buffer of its own. What the cache keeps between steps is a few rows
    cut out of chunk-wide arrays, and an MLX slice may share its parent's buffer (keeping all of it
    alive); the copy makes "the cache holds only its rows" hold whatever MLX does with slices."""
    return mx.contiguous(rows)


class RowBuffer:
    """Append-only [rows, width] buffer with spare capacity, so decode does not copy the whole cache
    on every emitted row (same idea as mlx-lm's KVCache step)."""

    STEP = 256

    def __init__(self, width: int, dtype: mx.Dtype = mx.float32) -> None:
        self.width, self.dtype = width, dtype
        self.num_rows = 0
        self._data: mx.array | None = None

    def append(self, rows: mx.array) -> None:
        n = rows.shape[0]
        if n == 0:
            return
        needed = self.num_rows + n
        if self._data is None or needed > self._data.shape[0]:
            capacity = max(needed, self.num_rows + self.num_rows // 4, self.STEP)
            capacity = -(-capacity // self.STEP) * self.STEP
            grown = mx.zeros((capacity, self.width), dtype=self.dtype)
            if self.num_rows:
                grown[: self.num_rows] = self._data[: self.num_rows]
            self._data = grown
        self._data[self.num_rows : needed] = rows.astype(self.dtype)
        self.num_rows = needed

    @classmethod
    def holding(cls, rows: mx.array, capacity: int) -> "RowBuffer":
        """A buffer holding `rows` [n, width] with room for `capacity` rows (≥ n): the state appends of a
        prefill leave it in, made at once (engine/tools/cache_fill.py)."""
        buffer = cls(rows.shape[1], rows.dtype)
        if capacity < rows.shape[0]:
            raise ValueError(f"capacity {capacity} is less than the {rows.shape[0]} rows it must hold")
        if capacity:
            buffer._data = mx.zeros((capacity, buffer.width), dtype=buffer.dtype)
            buffer._data[: rows.shape[0]] = rows
            buffer.num_rows = rows.shape[0]
        return buffer

    def view(self) -> mx.array:
        """[num_rows, width]."""
        if self._data is None:
            return mx.zeros((0, self.width), dtype=self.dtype)
        return self._data[: self.num_rows]

    def rows(self, start: int, end: int) -> mx.array:
        """[end - start, width]: a copy of rows [start, end), independent of later appends."""
        return owned(self.view()[start:end])

    def arrays(self) -> list[mx.array]:
        return [] if self._data is None else [self._data]

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held (what a sequence needs); capacity slack is at most one step."""
        return self.num_rows * self.width * self.dtype.size

    @property
    def capacity_nbytes(self) -> int:
        return 0 if self._data is None else self._data.nbytes


@dataclass
class CompressorFrontier:
    """What a compressor carries between calls: the open group's projected rows (fewer than `ratio`,
    gate without the positional bias) and, for the overlapping ratio-4 compressor, the previous
    window's Ca half (kv and biased gate) (docs/ARCHITECTURE.md: transformers' own cached decode gets this wrong)."""

    pending_kv: mx.array | None = None  # [n_open, width]
    pending_gate: mx.array | None = None  # [n_open, width]
    overlap_kv: mx.array | None = None  # [ratio, head_dim]
    overlap_gate: mx.array | None = None  # [ratio, head_dim]
    num_emitted: int = 0

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


@dataclass
class LayerCache:
    window: mx.array  # [≤ sliding_window - 1, head_dim]: the rows a later query can still see
    compressed: RowBuffer | None = None  # [num_compressed, head_dim] (CSA/HCA)
    compressor: CompressorFrontier | None = None
    index_keys: RowBuffer | None = None  # [num_compressed, index_head_dim] (CSA)
    indexer_compressor: CompressorFrontier | None = None

    def arrays(self) -> list[mx.array]:
        out = [self.window]
        for part in (self.compressed, self.compressor, self.index_keys, self.indexer_compressor):
            if part is not None:
                out += part.arrays()
        return out

    @property
    def nbytes_by_part(self) -> dict[str, int]:
        return {
            "window": self.window.nbytes,
            "compressed": self.compressed.nbytes if self.compressed else 0,
            "index_keys": self.index_keys.nbytes if self.index_keys else 0,
            "frontier": sum(f.nbytes for f in (self.compressor, self.indexer_compressor) if f is not None),
        }

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_by_part.values())


@dataclass
class SequenceCache:
    layers: list[LayerCache]
    num_tokens: int = 0  # tokens already run through every layer
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype: mx.Dtype = mx.float32) -> "SequenceCache":
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            layer = LayerCache(window=mx.zeros((0, cfg.head_dim), dtype=dtype))
            if kind != WINDOW:
                layer.compressed = RowBuffer(cfg.head_dim, dtype)
                layer.compressor = CompressorFrontier()
            if kind == CSA:
                layer.index_keys = RowBuffer(cfg.index_head_dim, dtype)
                layer.indexer_compressor = CompressorFrontier()
            layers.append(layer)
        return cls(layers=layers)

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.arrays()]

    @property
    def nbytes_by_part(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for layer in self.layers:
            for part, n in layer.nbytes_by_part.items():
                total[part] = total.get(part, 0) + n
        return total

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


# ---- resumable state (prefix cache, engine/serving/prefix_cache.py) ---------------------------------


@dataclass(frozen=True)
class LayerState:
    """One layer's cache at some token count, minus its append-only rows: those are only counted.

    The arrays are shared, never copied: the cache replaces its window and frontier arrays at every
    step instead of writing into them (attention.py, compressor.py), so a reference stays valid."""

    window: mx.array  # [≤ sliding_window - 1, head_dim]
    compressor: CompressorFrontier | None
    indexer_compressor: CompressorFrontier | None
    num_compressed: int
    num_index_keys: int

    @property
    def nbytes(self) -> int:
        frontiers = (self.compressor, self.indexer_compressor)
        return self.window.nbytes + sum(f.nbytes for f in frontiers if f is not None)

    def arrays(self) -> list[mx.array]:
        frontiers = (self.compressor, self.indexer_compressor)
        return [self.window] + [a for f in frontiers if f is not None for a in f.arrays()]


@dataclass(frozen=True)
class ResumeState:
    """Everything but the rows a sequence needs to continue after its first `num_tokens` tokens."""

    num_tokens: int
    layers: tuple[LayerState, ...]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.arrays()]


@dataclass(frozen=True)
class LayerRows:
    """Rows a layer appended over some span of tokens (empty arrays for a window-only layer)."""

    compressed: mx.array | None  # [n, head_dim]
    index_keys: mx.array | None  # [n, index_head_dim]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.compressed, self.index_keys) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


def _frontier_copy(frontier: CompressorFrontier | None) -> CompressorFrontier | None:
    return None if frontier is None else replace(frontier)


def resume_state(cache: SequenceCache) -> ResumeState:
    """The cache's state now (shares its arrays; see LayerState)."""
    layers = tuple(
        LayerState(
            window=layer.window,
            compressor=_frontier_copy(layer.compressor),
            indexer_compressor=_frontier_copy(layer.indexer_compressor),
            num_compressed=layer.compressed.num_rows if layer.compressed else 0,
            num_index_keys=layer.index_keys.num_rows if layer.index_keys else 0,
        )
        for layer in cache.layers
    )
    return ResumeState(cache.num_tokens, layers)


def rewind(cache: SequenceCache, state: ResumeState) -> None:
    """Puts `cache` back to `state`, taken from it earlier: rows appended since are dropped by count (the
    model only appends past `num_rows` and rebinds windows and frontiers, never writes kept arrays)."""
    cache.num_tokens = state.num_tokens
    del cache.token_ids[state.num_tokens:]
    for layer, saved in zip(cache.layers, state.layers):
        layer.window = saved.window
        if layer.compressed is not None:
            layer.compressed.num_rows = saved.num_compressed
        if layer.index_keys is not None:
            layer.index_keys.num_rows = saved.num_index_keys
        layer.compressor = _frontier_copy(saved.compressor)
        layer.indexer_compressor = _frontier_copy(saved.indexer_compressor)


def rows_between(cache: SequenceCache, start: ResumeState | None, end: ResumeState) -> tuple[LayerRows, ...]:
    """Copies of the rows each layer appended between two states of this cache (start None: from 0)."""
    out = []
    for i, layer in enumerate(cache.layers):
        lo = start.layers[i] if start is not None else None
        hi = end.layers[i]
        compressed = keys = None
        if layer.compressed is not None:
            compressed = layer.compressed.rows(lo.num_compressed if lo else 0, hi.num_compressed)
        if layer.index_keys is not None:
            keys = layer.index_keys.rows(lo.num_index_keys if lo else 0, hi.num_index_keys)
        out.append(LayerRows(compressed, keys))
    return tuple(out)


def restored_cache(
    cfg: ModelConfig, dtype: mx.Dtype, spans: list[tuple[LayerRows, ...]], state: ResumeState, token_ids: list[int]
) -> SequenceCache:
    """A fresh cache equal to the one `state` was taken from, given the rows it had appended, span by
    span from token 0. The rows are copied into the new cache's own buffers (it appends to them);
    window and frontier are shared (replaced, never written, by the model)."""
    cache = SequenceCache.for_model(cfg, dtype)
    for i, layer in enumerate(cache.layers):
        saved = state.layers[i]
        layer.window = saved.window
        if layer.compressed is not None:
            layer.compressed.append(_joined([span[i].compressed for span in spans]))
            layer.compressor = _frontier_copy(saved.compressor)
        if layer.index_keys is not None:
            layer.index_keys.append(_joined([span[i].index_keys for span in spans]))
            layer.indexer_compressor = _frontier_copy(saved.indexer_compressor)
        if (layer.compressed and layer.compressed.num_rows != saved.num_compressed) or (
            layer.index_keys and layer.index_keys.num_rows != saved.num_index_keys
        ):
            raise ValueError(f"layer {i}: the saved spans do not add up to the saved state's rows")
    cache.num_tokens = state.num_tokens
    cache.token_ids = list(token_ids[: state.num_tokens])
    return cache


def _joined(parts: list[mx.array]) -> mx.array:
    parts = [p for p in parts if p.shape[0]]
    if not parts:
        return mx.zeros((0, 0))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
