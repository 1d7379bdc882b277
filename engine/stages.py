"""Per-stage wall time of a forward pass (indexer score, top-k, attention, MoE, other).

MLX is lazy: a stage's time is only its own if the graph is evaluated at the stage boundary, so
`stage()` evaluates what it is given. The tile loop relies on that anyway: evaluating each tile
before building the next is what keeps one tile's scratch alive at a time (DESIGN.md §3).
"""

from __future__ import annotations

import time
from collections import defaultdict

import mlx.core as mx

STAGES = ("indexer_score", "topk", "attention", "moe", "other")


class StageTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._last = time.perf_counter()

    def stage(self, name: str, *arrays: mx.array) -> mx.array:
        """Evaluate `arrays` and charge the time since the previous boundary to `name`."""
        mx.eval(*arrays)
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self._last = now
        return arrays[0]

    def as_dict(self) -> dict[str, float]:
        return {name: self.seconds.get(name, 0.0) for name in STAGES}
