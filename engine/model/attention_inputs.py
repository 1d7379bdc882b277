"""What one layer's attention reads besides the activations: its weights and the step's segments
(shared by the per-segment tile path, engine/model/attention.py, and the batched decode path,
engine/model/decode_attention.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import cached_property

import mlx.core as mx

from tessera.engine.model.cache import LayerCache
from tessera.engine.model.compressor import CompressorWeights
from tessera.engine.model.quantized import Weight, format_key, linear, row_range, stacked_rows

# The layer's projections of its block input x [T, D], by field path in AttentionWeights, in the order their
# rows are stacked (StackedInputs).
INPUT_PROJECTIONS = ("wq_a", "wkv", "index_weights_proj", "compressor.wkv", "compressor.wgate",
                     "index_compressor.wkv", "index_compressor.wgate")


@dataclass(frozen=True)
class StackedGroup:
    """Input projections of one storage format, stacked row-wise: one matmul for all of them."""

    weight: Weight  # [Σ widths, D]
    parts: tuple[str, ...]  # INPUT_PROJECTIONS names, in row order
    widths: tuple[int, ...]  # each part's output width

    @cached_property
    def edges(self) -> list[int]:
        """Where the parts meet in the stacked output's last axis (made once, not in every step)."""
        return list(itertools.accumulate(self.widths[:-1]))


@dataclass(frozen=True)
class StackedInputs:
    """A layer's input projections as few matmuls: one per storage format (an official checkpoint has two:
    FP8 q_a and kv; BF16 index head weights and the compressors' kv and gate). A decode step computes its
    rows' projections with them, so a CSA layer launches 2 matmuls where it launched 7 (docs/ARCHITECTURE.md,
    "Stacked input projections")."""

    groups: tuple[StackedGroup, ...]

    def project(self, x: mx.array) -> dict[str, mx.array]:
        """x [T, D] -> {part name: [T, width]} for every part of every group."""
        out: dict[str, mx.array] = {}
        for group in self.groups:
            y = linear(x, group.weight)  # [T, Σ widths]
            out.update(zip(group.parts, mx.split(y, group.edges, axis=-1) if group.edges else [y]))
        return out


@dataclass(frozen=True)
class AttentionWeights:
    wq_a: Weight  # [q_lora, D]
    q_norm: mx.array  # [q_lora]
    wq_b: Weight  # [H·hd, q_lora]
    wkv: Weight  # [hd, D]
    kv_norm: mx.array  # [hd]
    wo_a: Weight  # [G·o_lora, H·hd / G]
    wo_b: Weight  # [D, G·o_lora]
    sinks: mx.array  # [H]
    compressor: CompressorWeights | None = None
    index_compressor: CompressorWeights | None = None
    index_wq_b: Weight | None = None  # [IH·ID, q_lora]
    index_weights_proj: Weight | None = None  # [IH, D]
    stacked_inputs: StackedInputs | None = None  # the input projections above, stacked (`with_stacked_inputs`)


def with_stacked_inputs(w: AttentionWeights) -> tuple[AttentionWeights, dict[str, Weight]]:
    """w with its input projections stacked by storage format, and each projection's field now a view of its
    group's rows (one copy of the weights, not two) -> (that AttentionWeights, {INPUT_PROJECTIONS name: the
    view}, for the caller to rebind whatever else held the old arrays so they are freed)."""
    present = {name: projection_weight(w, name) for name in INPUT_PROJECTIONS if projection_weight(w, name) is not None}
    by_format: dict[tuple, list[str]] = {}
    for name, weight in present.items():
        by_format.setdefault(format_key(weight), []).append(name)
    groups, views = [], {}
    for names in by_format.values():
        parts = [present[n] for n in names]
        widths = tuple(part.shape[0] for part in parts)
        stacked = stacked_rows(parts) if len(parts) > 1 else parts[0]
        starts = [0, *itertools.accumulate(widths)]
        for name, start, stop in zip(names, starts, starts[1:]):
            views[name] = row_range(stacked, start, stop) if len(parts) > 1 else present[name]
        groups.append(StackedGroup(stacked, tuple(names), widths))
    out = replace(w, wq_a=views["wq_a"], wkv=views["wkv"], index_weights_proj=views.get("index_weights_proj"),
                  stacked_inputs=StackedInputs(tuple(groups)))
    for compressor in ("compressor", "index_compressor"):
        if getattr(w, compressor) is not None:
            out = replace(out, **{compressor: replace(getattr(w, compressor), wkv=views[compressor + ".wkv"],
                                                      wgate=views[compressor + ".wgate"])})
    return out, views


def projection_weight(w: AttentionWeights, path: str) -> Weight | None:
    """The weight at an INPUT_PROJECTIONS path (`compressor.wkv`: w.compressor.wkv), None where w has none."""
    owner, _, name = path.rpartition(".")
    holder = getattr(w, owner) if owner else w
    return None if holder is None else getattr(holder, name)


@dataclass(frozen=True)
class SegmentSlice:
    """Tokens [offset, offset + length) of the step's flat batch belong to one sequence whose cache
    already holds `start` tokens."""

    offset: int
    length: int
    start: int
    cache: LayerCache
