"""What a forward pass leaves behind for benchmarks and checks: per-stage wall time (indexer score,
top-k, attention, MoE, other) and, when asked, the indexer's selected rows per layer and position.

MLX is lazy: a stage's time is only its own if the graph is evaluated at the stage boundary. Two
kinds of evaluation points exist. `boundary()` always evaluates: the tile loop relies on it to keep
one tile's scratch alive at a time (docs/ARCHITECTURE.md, "Tiling invariants"), the layer loop to keep one layer's graph.
`stage()` evaluates only with `stage_sync` on: each such sync drains the GPU's queue while Python
builds the next ops, so without it a stage's time is charged to the next point that does evaluate
(coarser attribution, fewer bubbles).

Without stage syncs a prefill's tiles are pipelined (engine/model/attention.py): tile i+1's graph is
built while tile i runs. `pipeline_tiles=False` makes each tile block instead (evaluate, then build
the next), which is what `bench compare`'s `C:T:blocking` setting measures the pipelining against.
"""

from __future__ import annotations

import time
from collections import defaultdict

import mlx.core as mx

STAGES = ("indexer_score", "topk", "attention", "moe", "other")


class ForwardTrace:
    def __init__(self, record_selections: bool = False, stage_sync: bool = True, pipeline_tiles: bool = True) -> None:
        self.stage_sync = stage_sync
        # A stage-synced run waits at every stage anyway: there is nothing left to overlap.
        self.pipelines_tiles = pipeline_tiles and not stage_sync
        self.seconds: dict[str, float] = defaultdict(float)
        self._last = time.perf_counter()
        # (layer, absolute position) -> selected compressed rows, ascending (valid picks only)
        self.selections: dict[tuple[int, int], tuple[int, ...]] | None = {} if record_selections else None

    def record_selection(self, layer: int, first_position: int, rows: mx.array, valid: mx.array) -> None:
        if self.selections is None:
            return
        for offset, (row, ok) in enumerate(zip(rows.tolist(), valid.tolist())):
            self.selections[(layer, first_position + offset)] = tuple(r for r, v in zip(row, ok) if v)

    def stage(self, name: str, *arrays: mx.array) -> mx.array:
        """End of a stage: evaluate `arrays` and charge the time since the previous evaluation to
        `name` — only with stage_sync on; otherwise nothing happens here."""
        if self.stage_sync:
            self.boundary(name, *arrays)
        return arrays[0]

    def boundary(self, name: str, *arrays: mx.array) -> mx.array:
        """Evaluate `arrays` (memory depends on it) and charge the time since the previous
        evaluation to `name`."""
        mx.eval(*arrays)
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self._last = now
        return arrays[0]

    def as_dict(self) -> dict[str, float]:
        """Seconds per stage; empty without stage_sync (the boundaries alone do not separate stages)."""
        if not self.stage_sync:
            return {}
        return {name: self.seconds.get(name, 0.0) for name in STAGES}
