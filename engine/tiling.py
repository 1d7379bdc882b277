"""How many query rows one tile takes at each layer (DESIGN.md §3).

The configured tile T is the row count at the step's widest layer: the layer kind whose tile
scratch per query row is the largest (at 1M context, HCA's logits over 8,192 compressed rows for
every head). Narrower kinds take as many rows as fit in that same scratch, split evenly over the
segment. Memory stays bounded by what T rows need, while the window layers, and the CSA layers when
HCA is the widest, run in fewer and larger tiles. Fewer tiles matter on a GPU: each tile ends in an
evaluation, and each evaluation costs a host round trip (about 1.3 ms measured on the H200,
docs/BENCHMARKS.md §4.3). A row's result does not depend on its tile (§3.3), so the tile sizes
change the time a prefill takes, never its results.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.memory_plan import attention_buffers, indexer_buffers, layer_tile_bytes

# MLX's CUDA kernels index an array with 32-bit integers (measured: an illegal memory access beyond).
MAX_TILE_ELEMENTS = 2**31 - 1


def layer_tiles(cfg: ModelConfig, ctx: int, length: int, tile: int, b: int, scale: bool = True) -> dict[str, int]:
    """Rows per tile for each layer kind of the model, for a segment of `length` query rows after
    which the cache holds `ctx` tokens; `b`: bytes per element of the compute dtype.
    `scale=False` gives every kind `tile` rows (the fixed tiling, for tests and comparisons)."""
    kinds = sorted(set(cfg.layer_types))
    if not scale or tile >= length:
        return {kind: min(tile, length) for kind in kinds}
    budget = max(layer_tile_bytes(cfg, kind, ctx, tile, b) for kind in kinds)
    return {kind: _rows_per_tile(_most_rows(cfg, kind, ctx, tile, length, budget, b), tile, length) for kind in kinds}


def largest_tile_array(cfg: ModelConfig, kind: str, ctx: int, rows: int) -> int:
    """Elements of the largest single array a tile allocates: the indexer's [rows, N/4] scores or
    the attention's [rows, heads, row set + 1] logits."""
    kinds = (kind,)
    buffers = indexer_buffers(cfg, ctx, rows, kinds) + attention_buffers(cfg, ctx, rows, 4, kinds)
    return max(buf.nbytes // 4 for buf in buffers if buf.name in ("indexer_scores", "attention_logits"))


def _most_rows(cfg: ModelConfig, kind: str, ctx: int, tile: int, length: int, budget: int, b: int) -> int:
    """The most rows in [tile, length] whose scratch at `kind` fits `budget` (bytes grow with rows,
    so a bisection finds it); never below `tile`, which the budget is made from."""
    lo, hi = tile, length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = layer_tile_bytes(cfg, kind, ctx, mid, b) <= budget
        if fits and largest_tile_array(cfg, kind, ctx, mid) <= MAX_TILE_ELEMENTS:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _rows_per_tile(most: int, tile: int, length: int) -> int:
    """As few tiles as `most` rows allow, sized evenly but never below T: 4096 rows at most 3,000
    give two tiles of 2048, not 3000 + 1096; the widest kind (most = T) keeps T."""
    num_tiles = -(-length // most)
    return max(tile, -(-length // num_tiles))
