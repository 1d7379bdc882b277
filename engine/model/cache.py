"""Per-sequence, per-layer cache: window rows, compressed rows, index keys and the
compressor frontier. The model declares the layout (`SequenceCache.for_model`); accounting of bytes
lives here too, so the memory plan and the scheduler read one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import numpy as np

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
        self._views: dict[tuple[int, bool], mx.array] = {}  # (num_rows, stacked) -> view of the current data

    def append(self, rows: mx.array) -> None:
        n = rows.shape[0]
        if n == 0:
            return
        self._views = {}  # views of the data before this append must not outlive it (they would pin its buffer)
        needed = self.num_rows + n
        if self._data is None or needed > self._data.shape[0]:
            capacity = max(needed, self.num_rows + self.num_rows // 4, self.STEP)
            capacity = -(-capacity // self.STEP) * self.STEP
            grown = mx.zeros((capacity, self.width), dtype=self.dtype)
            if self.num_rows:
                grown[: self.num_rows] = self._data[: self.num_rows]
            self._data = grown
        self._data[self.num_rows : needed] = rows if rows.dtype == self.dtype else rows.astype(self.dtype)
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
        """[num_rows, width]. The same array until the next append (or rewind), so decode steps between
        two appends do not slice every sequence's buffer again."""
        return self._view(stacked=False)

    def stackable_view(self) -> mx.array:
        """[1, num_rows, width]: `view` with a leading axis, for concatenating equal-length buffers."""
        return self._view(stacked=True)

    def _view(self, stacked: bool) -> mx.array:
        key = (self.num_rows, stacked)
        if key not in self._views:
            if self._data is None:
                rows = mx.zeros((0, self.width), dtype=self.dtype)
            else:
                rows = self._data[: self.num_rows]
            self._views = {k: v for k, v in self._views.items() if k[0] == self.num_rows}
            self._views[key] = rows[None] if stacked else rows
        return self._views[key]

    def data(self) -> mx.array | None:
        """The buffer (capacity rows; rows past num_rows are unused), for gathers of rows < num_rows."""
        return self._data

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


@dataclass(frozen=True)
class Stacked:
    """Row `index` of `batch` [b, ...]: one sequence's share of state that a decode step produced for
    b sequences at once. Kept as a reference, not cut out, so the next step of the same sequences
    takes the whole array back as it is (`stacked`): no per-sequence slice, copy or stack."""

    batch: mx.array
    index: int

    def value(self) -> mx.array:
        return self.batch[self.index]

    @property
    def nbytes(self) -> int:
        return self.batch.nbytes // self.batch.shape[0]


def stacked(parts: Sequence[mx.array | Stacked]) -> mx.array:
    """B per-sequence values of one shape (plain arrays, or rows of step-wide arrays) -> [B, ...].

    The rows of one array in their order (the same sequences as the step before) are that array;
    otherwise one gather per array they come from and one stack of the plain ones, so the cost
    grows with how many arrays the rows come from, not with B."""
    first = parts[0]
    if isinstance(first, Stacked) and all(isinstance(p, Stacked) and p.batch is first.batch for p in parts):
        indices = [p.index for p in parts]
        if indices == list(range(first.batch.shape[0])):
            return first.batch
        return first.batch[mx.array(indices)]
    sources: dict[int, tuple[mx.array, list[int], list[int]]] = {}  # id(batch) -> (batch, rows, positions)
    plain: list[int] = []
    for position, part in enumerate(parts):
        if isinstance(part, Stacked):
            sources.setdefault(id(part.batch), (part.batch, [], []))
            sources[id(part.batch)][1].append(part.index)
            sources[id(part.batch)][2].append(position)
        else:
            plain.append(position)
    pieces, order = [], []
    for batch, rows, positions in sources.values():
        pieces.append(batch[mx.array(rows)])
        order += positions
    if plain:
        pieces.append(mx.stack([parts[i] for i in plain]))
        order += plain
    joined = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
    if order == list(range(len(parts))):
        return joined
    return joined[mx.array(np.argsort(np.array(order)))]


def value(part: mx.array | Stacked) -> mx.array:
    return part.value() if isinstance(part, Stacked) else part


@dataclass(frozen=True)
class FrontierSlots:
    """The open groups and overlap halves of b compressor frontiers, stacked (b = 1 after a prefill,
    B after a decode step of B sequences). Every open group has `ratio` slots; a frontier's first
    `num_open` are its open rows, the rest unused."""

    kv: mx.array  # [b, ratio, width]
    gate: mx.array  # [b, ratio, width] (without the positional bias)
    overlap_kv: mx.array | None = None  # [b, ratio, head_dim] (overlapping compressors, once a window closed)
    overlap_gate: mx.array | None = None  # [b, ratio, head_dim] (biased)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.kv, self.gate, self.overlap_kv, self.overlap_gate) if a is not None]


@dataclass(frozen=True)
class CompressorFrontier:
    """What a compressor carries between calls: the open group's projected rows (fewer than `ratio`,
    gate without the positional bias) and, for the overlapping ratio-4 compressor, the previous
    window's Ca half (kv and biased gate) (docs/ARCHITECTURE.md: transformers' own cached decode gets this wrong).

    A value: a compressor call returns a new frontier, never writes one, so a snapshot of a cache
    (`resume_state`) holds the frontier itself, not a copy. Its arrays are row `row` of `slots`
    (shared with the sequences it was decoded with); `slots` None: nothing open, no window closed."""

    num_emitted: int = 0
    num_open: int = 0
    slots: FrontierSlots | None = None
    row: int = 0

    @classmethod
    def holding(cls, pending_kv: mx.array, pending_gate: mx.array, overlap_kv: mx.array | None,
                overlap_gate: mx.array | None, num_emitted: int, ratio: int) -> "CompressorFrontier":
        """One sequence's frontier from its arrays: pending [n_open < ratio, width], overlap [ratio, d] or None."""
        num_open = pending_kv.shape[0]
        if num_open >= ratio:
            raise ValueError(f"an open group holds fewer than ratio={ratio} rows, not {num_open}")
        spare = mx.zeros((ratio - num_open, pending_kv.shape[1]), dtype=pending_kv.dtype)
        one = lambda a: None if a is None else owned(a)[None]  # noqa: E731
        slots = FrontierSlots(
            mx.concatenate([pending_kv, spare])[None], mx.concatenate([pending_gate, spare])[None],
            one(overlap_kv), one(overlap_gate),
        )
        return cls(num_emitted, num_open, slots, 0)

    @property
    def pending_kv(self) -> mx.array | None:
        """[num_open, width] (None when nothing is open)."""
        return None if not self.num_open else self.slots.kv[self.row, : self.num_open]

    @property
    def pending_gate(self) -> mx.array | None:
        return None if not self.num_open else self.slots.gate[self.row, : self.num_open]

    @property
    def overlap_kv(self) -> mx.array | None:
        """[ratio, head_dim], None before the first window closed (or for a non-overlapping compressor)."""
        if self.slots is None or self.slots.overlap_kv is None or not self.num_emitted:
            return None
        return self.slots.overlap_kv[self.row]

    @property
    def overlap_gate(self) -> mx.array | None:
        if self.slots is None or self.slots.overlap_gate is None or not self.num_emitted:
            return None
        return self.slots.overlap_gate[self.row]

    def contents(self) -> list[mx.array]:
        """This sequence's arrays (open rows, overlap halves), for comparing frontiers."""
        parts = (self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate)
        return [a for a in parts if a is not None]

    def arrays(self) -> list[mx.array]:
        """The arrays holding this frontier's memory (step-wide when it was decoded in a batch)."""
        return [] if self.slots is None else self.slots.arrays()

    @property
    def nbytes(self) -> int:
        """Bytes of this sequence's row of the slots: `ratio` open-group slots of kv and gate whatever
        `num_open` is (a fixed shape is what lets a step update every sequence's group in one op),
        and the overlap halves once a window closed."""
        if self.slots is None:
            return 0
        total = 2 * self.slots.kv.nbytes // self.slots.kv.shape[0]
        if self.num_emitted and self.slots.overlap_kv is not None:
            total += 2 * self.slots.overlap_kv.nbytes // self.slots.overlap_kv.shape[0]
        return total


@dataclass
class LayerCache:
    """`window` reads and writes the window rows; a decode step stores them as a row of its step-wide
    window array (`stored_window`, a `Stacked`), which the next step takes back whole."""

    stored_window: mx.array | Stacked  # [≤ sliding_window - 1, head_dim]: the rows a later query can still see
    compressed: RowBuffer | None = None  # [num_compressed, head_dim] (CSA/HCA)
    compressor: CompressorFrontier | None = None
    index_keys: RowBuffer | None = None  # [num_compressed, index_head_dim] (CSA)
    indexer_compressor: CompressorFrontier | None = None

    @property
    def window(self) -> mx.array:
        return value(self.stored_window)

    @window.setter
    def window(self, rows: mx.array | Stacked) -> None:
        self.stored_window = rows

    @property
    def num_window_rows(self) -> int:
        w = self.stored_window
        return w.batch.shape[1] if isinstance(w, Stacked) else w.shape[0]

    def arrays(self) -> list[mx.array]:
        w = self.stored_window
        out = [w.batch if isinstance(w, Stacked) else w]
        for part in (self.compressed, self.compressor, self.index_keys, self.indexer_compressor):
            if part is not None:
                out += part.arrays()
        return out

    def contents(self) -> list[mx.array]:
        """This sequence's own arrays (window, compressed rows, frontiers, index keys), for comparisons."""
        out = [self.window]
        for buf, frontier in ((self.compressed, self.compressor), (self.index_keys, self.indexer_compressor)):
            if buf is not None:
                out.append(buf.view())
            if frontier is not None:
                out += frontier.contents()
        return out

    @property
    def nbytes_by_part(self) -> dict[str, int]:
        return {
            "window": self.stored_window.nbytes,
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
            layer = LayerCache(mx.zeros((0, cfg.head_dim), dtype=dtype))
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

    def contents(self) -> list[mx.array]:
        """Every layer's `contents`: this sequence's arrays, whatever arrays they are stored in."""
        return [a for layer in self.layers for a in layer.contents()]

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
    step instead of writing into them (attention.py, decode_attention.py, compressor.py), so a
    reference stays valid. After a batched decode step they are rows of that step's arrays (`Stacked`,
    `FrontierSlots`): `detached` cuts them out for a state kept longer than a step."""

    window: mx.array | Stacked  # [≤ sliding_window - 1, head_dim]
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
        window = self.window.batch if isinstance(self.window, Stacked) else self.window
        return [window] + [a for f in frontiers if f is not None for a in f.arrays()]


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


def detached(state: ResumeState) -> ResumeState:
    """`state` with its window and frontiers in arrays of their own (each a few rows), for a state
    kept past the step it was taken in (the prefix cache): rows of a batched step's arrays would keep
    every sequence's share of them alive."""
    layers = tuple(
        LayerState(owned(value(layer.window)), _detached(layer.compressor), _detached(layer.indexer_compressor),
                   layer.num_compressed, layer.num_index_keys)
        for layer in state.layers
    )
    return ResumeState(state.num_tokens, layers)


def _detached(frontier: CompressorFrontier | None) -> CompressorFrontier | None:
    if frontier is None or frontier.slots is None or frontier.slots.kv.shape[0] == 1:
        return frontier
    row = lambda a: None if a is None else owned(a[frontier.row : frontier.row + 1])  # noqa: E731
    slots = FrontierSlots(*(row(a) for a in (frontier.slots.kv, frontier.slots.gate, frontier.slots.overlap_kv,
                                               frontier.slots.overlap_gate)))
    return CompressorFrontier(frontier.num_emitted, frontier.num_open, slots, 0)


def resume_state(cache: SequenceCache) -> ResumeState:
    """The cache's state now: references to its window and frontiers, no copy and no graph op (see
    LayerState) — the runner takes one per sequence and step to undo a failed step."""
    layers = tuple(
        LayerState(
            window=layer.stored_window,
            compressor=layer.compressor,
            indexer_compressor=layer.indexer_compressor,
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
        layer.compressor = saved.compressor
        layer.indexer_compressor = saved.indexer_compressor


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
            layer.compressor = saved.compressor
        if layer.index_keys is not None:
            layer.index_keys.append(_joined([span[i].index_keys for span in spans]))
            layer.indexer_compressor = saved.indexer_compressor
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
