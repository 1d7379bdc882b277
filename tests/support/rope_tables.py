"""RoPE tables from arbitrary angles: tests rotate by random cos / sin, not a spec's positions."""

from __future__ import annotations

import mlx.core as mx

from tessera.engine.model.rope import RopeTables


def padded_rope_tables(cos: mx.array, sin: mx.array, width: int) -> RopeTables:
    """cos, sin [L, half] of the trailing 2·half channels -> the tables of heads `width` channels wide (the
    leading pairs' entries cos 1, sin 0: placeholders `apply_rope` passes through), sin signed as RopeTables holds it."""
    rows, half = cos.shape
    lead = width // 2 - half

    def padded(table: mx.array, fill: float) -> mx.array:
        return mx.concatenate([mx.full((rows, lead), fill, dtype=table.dtype), table], axis=1).reshape(rows, 1, -1, 1)

    return RopeTables(padded(cos, 1.0), padded(sin, 0.0) * mx.array([-1.0, 1.0]), rotated=half)
