"""Memory plan (`tessera plan`; README.md): bytes of every chunk- and tile-scaled buffer of a prefill, the cache of
one sequence at N tokens, and the weights — from the model config alone.

The same numbers feed `tessera plan`, admission control (a sequence's cache at its max length) and
the Prometheus memory gauges; `tessera bench prefill` checks the planned peak against MLX's measured
peak. Buffers are listed as this engine allocates them (engine/model/attention.py, kernels/), so a change
there that adds a [T, N] temporary belongs here too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from math import prod
from pathlib import Path

from tessera.engine.model.attention import ATTENTION_ROWS, PROJECTION_ROWS, attention_blocks
from tessera.engine.model.cache import RowBuffer
from tessera.engine.model.config import CSA, HCA, V4_FLASH, WINDOW, ModelConfig, config_from_dict
from tessera.engine.model.dtypes import DTYPES
from tessera.engine.model.moe import PADDED_MAX_ROWS_PER_PAIR
from tessera.engine.model.official_format import storage
from tessera.engine.model.quantized import dense_min_rows
from tessera.engine.model.weights import expected_shapes, held_itemsize, layer_of

GiB = 2**30


@dataclass(frozen=True)
class Buffer:
    name: str
    nbytes: int
    formula: str  # how it scales, for a reader of `tessera plan`


@dataclass(frozen=True)
class MemoryPlan:
    ctx: int
    chunk: int
    tile: int
    dtype: str
    indexer: list[Buffer]  # per CSA tile, one reused scratch: bounded by T, not C
    attention: list[Buffer]  # per tile of the mixed attention
    chunk_activations: list[Buffer]  # the layer pipeline on the whole chunk (C)
    cache_by_part: dict[str, int]
    weights_bytes: int
    notes: list[str] = field(default_factory=list)
    weights_format: str = ""  # engine/model/weight_formats.py; "" = every tensor in `dtype`
    memory_budget: int | None = None  # bytes the machine gives this process (`--memory-budget`)

    @property
    def fits(self) -> bool | None:
        return None if self.memory_budget is None else self.peak_bytes <= self.memory_budget

    @property
    def indexer_bytes(self) -> int:
        return sum(b.nbytes for b in self.indexer)

    @property
    def attention_bytes(self) -> int:
        return sum(b.nbytes for b in self.attention)

    @property
    def chunk_bytes(self) -> int:
        return sum(b.nbytes for b in self.chunk_activations)

    @property
    def cache_bytes(self) -> int:
        return sum(self.cache_by_part.values())

    @property
    def workspace_bytes(self) -> int:
        """Chunk activations plus the larger of the two tile workspaces (they are never live together)."""
        return self.chunk_bytes + max(self.indexer_bytes, self.attention_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.cache_bytes + self.workspace_bytes

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(
            indexer_bytes=self.indexer_bytes,
            attention_bytes=self.attention_bytes,
            chunk_bytes=self.chunk_bytes,
            cache_bytes=self.cache_bytes,
            workspace_bytes=self.workspace_bytes,
            peak_bytes=self.peak_bytes,
            fits=self.fits,
        )
        return out


# ---- the plan ----------------------------------------------------------------------------------


def make_plan(cfg: ModelConfig, ctx: int, chunk: int, tile: int, dtype: str = "float32",
              quantized_dense: bool = False) -> MemoryPlan:
    """quantized_dense: the dense projections are held quantized (an official or converted checkpoint),
    so a large step computes on a transient dequantized copy of one layer's (`dequantized_buffers`)."""
    if not 1 <= tile <= chunk:
        raise ValueError(f"indexer tile ({tile}) must be between 1 and the prefill chunk ({chunk})")
    b = DTYPES[dtype].size
    chunk_activations = chunk_buffers(cfg, chunk, b) + (dequantized_buffers(cfg, chunk, b) if quantized_dense else [])
    return MemoryPlan(
        ctx=ctx,
        chunk=chunk,
        tile=tile,
        dtype=dtype,
        indexer=indexer_buffers(cfg, ctx, tile),
        attention=attention_buffers(cfg, ctx, chunk, tile, b),
        chunk_activations=chunk_activations,
        cache_by_part=cache_bytes_by_part(cfg, ctx, chunk, b),
        weights_bytes=weights_bytes(cfg, b),
    )


def indexer_buffers(cfg: ModelConfig, ctx: int, tile: int) -> list[Buffer]:
    """One CSA tile: fp32 scores, the visibility-masked copy, the top-k sort scratch (the seed's
    'scores + mask + top-k' = 3 × T × N × 4 bytes), then the compact selection."""
    if CSA not in cfg.layer_types:
        return []
    rows = ctx // cfg.compress_rates[CSA]
    k = min(cfg.index_topk, rows)
    return [
        Buffer("indexer_scores", tile * rows * 4, "T × N/4 × 4 (fp32, heads accumulated in place)"),
        Buffer("indexer_mask", tile * rows * 4, "T × N/4 × 4 (masked scores)"),
        Buffer("topk_scratch", tile * rows * 4, "T × N/4 × 4 (sort indices)"),
        Buffer("selected_rows", tile * k * 4, "T × k × 4"),
    ]


def attention_buffers(cfg: ModelConfig, ctx: int, chunk: int, tile: int, b: int) -> list[Buffer]:
    """One tile of mixed attention at the widest layer (engine/model/attention.py): the tile's queries
    (projected in fixed blocks), its gathered window ∪ selected rows (one gather for the whole tile),
    the zero-padded copies of the blocks it covers only in part, and per ATTENTION_ROWS block the
    fp32 logits and probabilities for every head, then the output waiting for its projection block.
    A tile's blocks are one graph, evaluated together at the tile's end, so all of them count."""
    heads, hd, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    widest = _widest_row_set(cfg, ctx)
    gathered = w + min(cfg.index_topk, ctx // cfg.compress_rates[CSA]) if CSA in cfg.layer_types else w
    q_rows = tile + PROJECTION_ROWS  # a tile's blocks can reach one block beyond it
    index_q = cfg.index_n_heads * cfg.index_head_dim if CSA in cfg.layer_types else 0
    blocks, padded_rows = blocks_per_tile(chunk, tile)
    block_rows = blocks * ATTENTION_ROWS
    out = [
        Buffer("tile_queries", 2 * q_rows * (heads * hd + index_q) * b,
               "2 × (T + block) × (heads × head_dim + index_heads × index_head_dim) (blocks, joined)"),
        Buffer("gathered_rows", tile * gathered * hd * b, "T × (window + k) × head_dim × dtype"),
        Buffer("padded_blocks", padded_rows * (gathered + heads) * hd * b,
               "padded rows (< 2 × 2 × 128) × (window + k + heads) × head_dim × dtype (copies + zeros)"),
        Buffer("attention_logits", block_rows * heads * (widest + 1) * 4,
               "blocks × 128 × heads × (widest row set + sink) × 4"),
        Buffer("attention_probs", block_rows * heads * (widest + 1) * 4,
               "blocks × 128 × heads × (widest row set + sink) × 4"),
        Buffer("attention_out", q_rows * heads * hd * 4, "(T + block) × heads × head_dim × 4 (awaiting projection)"),
    ]
    if b < 4:  # products come out in the low precision first, and probabilities go back to it
        out.append(Buffer("attention_lowp_copies", 2 * block_rows * heads * (widest + 1) * b,
                          "2 × blocks × 128 × heads × (widest row set + sink) × dtype (product, probs copy)"))
    return out


def blocks_per_tile(chunk: int, tile: int) -> tuple[int, int]:
    """(blocks, padded rows): the most ATTENTION_ROWS blocks one tile of a `chunk`-row segment
    touches, and the most rows its zero-padded block copies take (a block the tile covers only in
    part is copied whole, next to its zero rows): `attention_blocks` on every tile."""
    most, most_padded = 0, 0
    for r0 in range(0, chunk, tile):
        touched = attention_blocks(r0, min(r0 + tile, chunk), chunk)
        padded = sum(2 * (b1 - b0) - (hi - lo) for b0, b1, lo, hi in touched if (lo, hi) != (b0, b1))
        most, most_padded = max(most, len(touched)), max(most_padded, padded)
    return most, most_padded


def attention_call_elements(cfg: ModelConfig, ctx: int) -> int:
    """Elements of the largest array one attention call makes: an ATTENTION_ROWS block's logits over
    the widest layer's rows (HCA's compressed rows at `ctx`, or window + top-k) plus the sink."""
    return ATTENTION_ROWS * cfg.num_attention_heads * (_widest_row_set(cfg, ctx) + 1)


def tile_array_elements(cfg: ModelConfig, ctx: int, tile: int) -> int:
    """Elements of the largest array one tile makes at `ctx`: the indexer's [T, N] scores (CSA) or the
    gathered window ∪ selected rows [T, window + k, head_dim] (one gather for the whole tile)."""
    if CSA not in cfg.layer_types:
        return tile * cfg.sliding_window * cfg.head_dim
    rows = ctx // cfg.compress_rates[CSA]
    return tile * max(rows, (cfg.sliding_window + min(cfg.index_topk, rows)) * cfg.head_dim)


def _widest_row_set(cfg: ModelConfig, ctx: int) -> int:
    """Rows a query attends to at the widest layer: the window, plus top-k (CSA) or every compressed row (HCA)."""
    widest = cfg.sliding_window
    if CSA in cfg.layer_types:
        widest = max(widest, cfg.sliding_window + min(cfg.index_topk, ctx // cfg.compress_rates[CSA]))
    if HCA in cfg.layer_types:
        widest = max(widest, cfg.sliding_window + ctx // cfg.compress_rates[HCA])
    return widest


def chunk_buffers(cfg: ModelConfig, chunk: int, b: int) -> list[Buffer]:
    """The layer pipeline on C tokens (one layer live at a time). The wide per-head queries and
    attention output are not here: they exist a projection block at a time (attention_buffers)."""
    c, d, hc = chunk, cfg.hidden_size, cfg.hc_mult
    narrow = cfg.q_lora_rank + cfg.head_dim + (cfg.index_n_heads if CSA in cfg.layer_types else 0)
    routed = cfg.num_experts_per_tok * cfg.moe_intermediate_size
    return [
        Buffer("hidden_streams", 2 * c * hc * d * b, "2 × C × hc × hidden (in and out of a layer)"),
        Buffer("block_input", 2 * c * d * b, "2 × C × hidden (collapsed streams, normed)"),
        Buffer("narrow_projections", c * narrow * b, "C × (q_lora + head_dim + index_heads)"),
        Buffer("attention_projected", c * d * b, "C × hidden (projected blocks, joined)"),
        # the padded MoE layout computes up to PADDED_MAX_ROWS_PER_PAIR rows per (token, expert) pair
        Buffer("moe_intermediate", int(3 * c * routed * b * PADDED_MAX_ROWS_PER_PAIR),
               f"3 × C × top_k × moe_intermediate × {PADDED_MAX_ROWS_PER_PAIR:g} (gate, up, product; padded layout)"),
        Buffer("router", 2 * c * cfg.n_routed_experts * 4, "2 × C × experts × 4"),
    ]


def dequantized_buffers(cfg: ModelConfig, chunk: int, b: int) -> list[Buffer]:
    """A step of >= dense_min_rows() rows runs a layer's FP8-class projections (attention and shared
    expert) on a dequantized copy made for that step (engine/model/quantized.py); counted as the
    largest layer's, all live at once (an upper bound: attention's copies die before the MoE's). No step has
    more rows than the chunk (decodes included: the scheduler keeps max_num_seqs <= prefill_chunk), so a chunk
    below the threshold means no step makes the copy."""
    threshold = dense_min_rows()
    if chunk < threshold:
        return []
    per_layer: dict[int, int] = {}
    for name, shape in expected_shapes(cfg).items():
        layer = layer_of(name)
        if layer is not None and storage(name) == "fp8":
            per_layer[layer] = per_layer.get(layer, 0) + prod(shape)
    largest = max(per_layer.values(), default=0)
    return [Buffer("dequantized_weights", largest * b,
                   f"one layer's FP8-class projections × dtype (steps of ≥ {threshold} rows)")]


def cache_bytes_by_part(cfg: ModelConfig, ctx: int, chunk: int | None, b: int,
                        layers: range | None = None) -> dict[str, int]:
    """One sequence's cache after `ctx` tokens prefilled in chunks of `chunk` (row buffers keep spare
    capacity; `chunk=None` counts rows only, the floor a sequence needs). `layers`: only those (a pipeline
    stage's, engine/parallel/); None: all."""
    parts = {"window": 0, "compressed": 0, "index_keys": 0, "frontier": 0}
    for i, kind in enumerate(cfg.layer_types):
        if layers is not None and i not in layers:
            continue
        parts["window"] += min(ctx, cfg.sliding_window - 1) * cfg.head_dim * b
        if kind == WINDOW:
            continue
        ratio = cfg.compress_rates[kind]
        parts["compressed"] += _rows_bytes(ctx, chunk, ratio, cfg.head_dim, b)
        width = 2 * cfg.head_dim if kind == CSA else cfg.head_dim
        open_slots = ratio if ctx else 0  # a frontier keeps `ratio` open-group slots (cache.FrontierSlots)
        parts["frontier"] += 2 * open_slots * width * b
        if kind == CSA:
            parts["index_keys"] += _rows_bytes(ctx, chunk, ratio, cfg.index_head_dim, b)
            parts["frontier"] += 2 * open_slots * 2 * cfg.index_head_dim * b
            if ctx >= ratio:
                parts["frontier"] += 2 * ratio * (cfg.head_dim + cfg.index_head_dim) * b
    return parts


def _rows_bytes(ctx: int, chunk: int | None, ratio: int, width: int, b: int) -> int:
    if chunk is None:
        return (ctx // ratio) * width * b
    return simulated_capacity(ctx, chunk, ratio) * width * b


def simulated_capacity(ctx: int, chunk: int, ratio: int) -> int:
    """Capacity RowBuffer ends with when rows arrive chunk by chunk (same growth rule as the cache)."""
    rows = capacity = 0
    step = RowBuffer.STEP
    for end in range(chunk, ctx + chunk, chunk):
        rows = min(end, ctx) // ratio
        if rows > capacity:
            grown = max(rows, capacity + capacity // 4, step)
            capacity = -(-grown // step) * step
    return capacity


def weights_bytes(cfg: ModelConfig, b: int) -> int:
    total = 0
    for name, shape in expected_shapes(cfg).items():
        held = held_itemsize(name)
        total += prod(shape) * (b if held is None else held)
    return total


def cache_bytes_at(cfg: ModelConfig, num_tokens: int, b: int, layers: range | None = None) -> int:
    """Admission control: what one sequence's cache holds at `num_tokens` (rows + one step of slack), in
    `layers` only (None: all)."""
    parts = cache_bytes_by_part(cfg, num_tokens, None, b, layers)
    slack = sum(RowBuffer.STEP * cfg.head_dim * b for i, kind in enumerate(cfg.layer_types)
                if kind != WINDOW and (layers is None or i in layers))
    return sum(parts.values()) + slack


# ---- the CLI's view ----------------------------------------------------------------------------



def plan_for(model_dir: Path | None, preset: str | None, ctx: int, chunk: int, tile: int, dtype: str | None,
             weights_format: str | None = None, memory_budget: int | None = None) -> MemoryPlan:
    """weights_format: count the weights as engine/model/weight_formats.py holds them (None: all in dtype)."""
    cfg, dtype = _config_and_dtype(model_dir, preset, dtype)
    plan = make_plan(cfg, ctx, chunk, tile, dtype)
    if weights_format:
        from tessera.engine.model.weight_formats import QUANTIZED_FORMATS, format_weights_bytes

        if weights_format in QUANTIZED_FORMATS:  # every quantized format keeps the dense projections mxfp8
            plan = replace(plan, chunk_activations=plan.chunk_activations
                           + dequantized_buffers(cfg, chunk, DTYPES[plan.dtype].size))
        plan = replace(plan, weights_format=weights_format,
                       weights_bytes=format_weights_bytes(cfg, weights_format, DTYPES[plan.dtype].size))
    return replace(plan, memory_budget=memory_budget)


def _config_and_dtype(model_dir: Path | None, preset: str | None, dtype: str | None) -> tuple[ModelConfig, str]:
    """The config (read once) and the dtype to plan in: `dtype`, else the checkpoint's, else the preset's."""
    if model_dir is not None:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        return config_from_dict(raw), dtype or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if preset == "v4-flash" or preset is None:
        return config_from_dict(V4_FLASH), dtype or "bfloat16"
    from tessera.engine.tools.make_model import preset_config

    return preset_config(preset), dtype or "float32"


def format_plan(plan: MemoryPlan) -> str:
    untiled_scratch = 3 * plan.chunk * (plan.indexer[0].nbytes // (plan.tile * 4)) * 4 if plan.indexer else 0
    lines = [f"memory plan: ctx {plan.ctx:,}  chunk C={plan.chunk}  tile T={plan.tile}  dtype {plan.dtype}", ""]
    for title, buffers in (("indexer tile (one reused scratch)", plan.indexer), ("attention tile", plan.attention),
                           ("chunk activations", plan.chunk_activations)):
        lines.append(f"{title}:")
        lines += [f"  {b.name:<20} {_gib(b.nbytes):>12}   {b.formula}" for b in buffers]
    lines.append("cache at ctx (one sequence):")
    lines += [f"  {part:<20} {_gib(n):>12}" for part, n in plan.cache_by_part.items()]
    scratch = sum(b.nbytes for b in plan.indexer[:3])
    lines += [
        "",
        f"indexer scores + mask + top-k scratch: {_gib(scratch)}  (untiled at this chunk: {_gib(untiled_scratch)})",
        f"weights {_gib(plan.weights_bytes)}  cache {_gib(plan.cache_bytes)}  workspace {_gib(plan.workspace_bytes)}",
        f"planned peak: {_gib(plan.peak_bytes)}",
    ]
    if plan.weights_format:
        lines.insert(-2, f"weights format: {plan.weights_format} (quantized values + scales as MLX holds them)")
    if plan.memory_budget is not None:
        lines.append(fit_line(plan))
    return "\n".join(lines)


def fit_line(plan: MemoryPlan) -> str:
    margin = plan.memory_budget - plan.peak_bytes
    verdict = "fits" if margin >= 0 else "does NOT fit"
    word = "headroom" if margin >= 0 else "over by"
    return (f"{verdict} in {_gib(plan.memory_budget)}: weights {_gib(plan.weights_bytes)} + cache at {plan.ctx:,} "
            f"{_gib(plan.cache_bytes)} + workspace {_gib(plan.workspace_bytes)} = {_gib(plan.peak_bytes)} ({word} {_gib(abs(margin))})")


def _gib(n: int) -> str:
    return f"{n / GiB:,.3f} GiB"
