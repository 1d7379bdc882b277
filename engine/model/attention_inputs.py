"""What one layer's attention reads besides the activations: its weights and the step's segments
(shared by the per-segment tile path, engine/model/attention.py, and the batched decode path,
engine/model/decode_attention.py)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from tessera.engine.model.cache import LayerCache
from tessera.engine.model.compressor import CompressorWeights
from tessera.engine.model.quantized import Weight


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


@dataclass(frozen=True)
class SegmentSlice:
    """Tokens [offset, offset + length) of the step's flat batch belong to one sequence whose cache
    already holds `start` tokens."""

    offset: int
    length: int
    start: int
    cache: LayerCache
