"""`tessera check consistency` (ds4's "decode consistency"): after changing chunk or tile, prefill
with (C, T) and decode M tokens, then compare with (a) the untiled prefill (T = C) and the same
decodes — selected rows and logits — and (b) a fresh whole-sequence prefill at every decoded
position. On CPU in float32 with a row-invariant BLAS every difference is exactly zero
(docs/ARCHITECTURE.md, "Tiling invariants"); OpenBLAS's gemm is not row-invariant, so across chunk sizes a few
ulps appear. `consistency_failures` applies the thresholds of engine/tools/check_limits.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tessera.engine.model.loader import load_model
from tessera.engine.model.deepseek_v4 import DeepseekV4
from tessera.engine.tools.check_limits import ConsistencyLimits
from tessera.engine.tools.replay import random_tokens, run_sequence
from tessera.engine.serving.runner import default_compute_dtype


# The fresh whole-sequence prefill runs in one untiled chunk up to this many tokens: MLX's GPU sorts
# (top-k, MoE routing) reject more than 65,535 rows in one call.
WHOLE_CHUNK_LIMIT = 32768


@dataclass(frozen=True)
class ConsistencyReport:
    ctx: int
    chunk: int
    tile: int
    decode: int
    max_abs_diff: float
    untiled_max_abs_diff: float
    whole_sequence_max_abs_diff: float
    differing_selections: int
    compared_selections: int

    def as_dict(self) -> dict:
        return asdict(self)


def consistency_failures(report: ConsistencyReport, limits: ConsistencyLimits) -> list[str]:
    """One line per exceeded threshold (empty: the check passed)."""
    checks = [
        ("untiled_max_abs_diff", report.untiled_max_abs_diff, limits.untiled_diff, "--max-untiled-diff"),
        ("whole_sequence_max_abs_diff", report.whole_sequence_max_abs_diff, limits.whole_sequence_diff,
         "--max-whole-sequence-diff"),
        ("differing_selections", report.differing_selections, limits.differing_selections,
         "--max-differing-selections"),
    ]
    return [f"{name} = {value} exceeds {flag} {limit}" for name, value, limit, flag in checks if value > limit]


def differing(a: dict, b: dict, keys=None) -> tuple[int, int]:
    keys = sorted(set(a) | set(b)) if keys is None else keys
    return sum(a.get(k) != b.get(k) for k in keys), len(keys)


def check_model_consistency(model: DeepseekV4, ctx: int, decode: int, chunk: int, tile: int, seed: int = 0) -> ConsistencyReport:
    tokens = random_tokens(model.cfg.vocab_size, ctx + decode, seed)
    tiled = run_sequence(model, tokens, ctx, chunk, tile)
    untiled = run_sequence(model, tokens, ctx, chunk, chunk)
    untiled_diff = float(np.abs(tiled.logits - untiled.logits).max())
    num_diff, num_compared = differing(tiled.selections, untiled.selections)
    whole_diff = 0.0
    for p in range(ctx, ctx + decode):  # a fresh whole-sequence prefill ending at each decoded position
        fresh = min(p + 1, WHOLE_CHUNK_LIMIT)
        whole = run_sequence(model, tokens[: p + 1], p + 1, fresh, fresh)
        whole_diff = max(whole_diff, float(np.abs(whole.logits[-1] - tiled.logits[p]).max()))
        keys = [k for k in whole.selections if k[1] == p]
        d, n = differing(tiled.selections, whole.selections, keys)
        num_diff, num_compared = num_diff + d, num_compared + n
    return ConsistencyReport(
        ctx=ctx, chunk=chunk, tile=tile, decode=decode,
        max_abs_diff=max(untiled_diff, whole_diff),
        untiled_max_abs_diff=untiled_diff,
        whole_sequence_max_abs_diff=whole_diff,
        differing_selections=num_diff,
        compared_selections=num_compared,
    )


def check_consistency(model_dir: Path, ctx: int, decode: int, chunk: int, tile: int, seed: int = 0,
                      dtype: str | None = None) -> ConsistencyReport:
    model = load_model(Path(model_dir), dtype=dtype or default_compute_dtype())
    return check_model_consistency(model, ctx, decode, chunk, tile, seed)
