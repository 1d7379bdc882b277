"""Bytes of a V4 checkpoint's weights as Tessera holds them in memory, per weights format — what
`tessera plan --weights` counts (values + scales + biases):

- `official`: DeepSeek's release as loaded: FP8 dense projections as MLX mxfp8 (1 byte per value +
  one E8M0 byte per 32, the 128×128 block scale repeated), FP4 experts as mxfp4 (½ byte + 1/32);
- `affine4` / `affine8` / `mxfp4`: `tessera convert` of the experts (dense stays the official mxfp8);
  affine groups of 64 carry a bf16 scale and bias each, mxfp4 groups of 32 one E8M0 byte;
- `bfloat16` / `float32` / `float16`: every tensor plain in that dtype (a dequantizing loader).

Tensors that stay float (embedding, head, compressor …) count at the compute dtype's size; the norms' weights,
the router and its bias at 4 bytes (float32), `tid2eid` at 4 (uint32): the dtypes the model holds them in
(weights.held_itemsize).
"""

from __future__ import annotations

from math import prod

from tessera.engine.model.config import ModelConfig
from tessera.engine.model.dtypes import DTYPES
from tessera.engine.model.official_format import storage
from tessera.engine.model.weights import expected_shapes, held_itemsize

# format -> bytes per value of (dense fp8-class projections, routed experts)
_QUANTIZED: dict[str, tuple[float, float]] = {
    "official": (1 + 1 / 32, 0.5 + 1 / 32),
    "mxfp4": (1 + 1 / 32, 0.5 + 1 / 32),
    "affine4": (1 + 1 / 32, 0.5 + 2 * 2 / 64),
    "affine8": (1 + 1 / 32, 1 + 2 * 2 / 64),
}
QUANTIZED_FORMATS = tuple(_QUANTIZED)
WEIGHT_FORMATS = QUANTIZED_FORMATS + tuple(DTYPES)


def format_weights_bytes(cfg: ModelConfig, weights_format: str, compute_bytes: int) -> int:
    if weights_format not in WEIGHT_FORMATS:
        raise ValueError(f"--weights: {weights_format!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    plain = DTYPES[weights_format].size if weights_format in DTYPES else compute_bytes
    dense, experts = _QUANTIZED.get(weights_format, (plain, plain))
    total = 0.0
    for name, shape in expected_shapes(cfg).items():
        held = held_itemsize(name)
        per_value = held if held is not None else {"fp8": dense, "fp4": experts}.get(storage(name), plain)
        total += prod(shape) * per_value
    return int(total)
