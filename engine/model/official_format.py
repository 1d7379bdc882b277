"""DeepSeek V4's official checkpoint format, as transformers 5.23 reads it
(models/deepseek_v4/modeling_deepseek_v4.py, integrations/finegrained_fp8.py):

- dense projections (attention q/kv/o, the indexer's `wq_b`, the shared expert): FP8 E4M3 `[out, in]`
  with a `<name>.scale` of E8M0 per 128×128 block, `[ceil(out/128), ceil(in/128)]`;
- routed experts (`expert_dtype: fp4`): E2M1 packed two per byte in `I8` `[out, in/2]` (low nibble
  first) with a `<name>.scale` of E8M0 per 32 inputs, `[out, in/32]`;
- BF16: the embedding, the head, the router, the compressor and indexer-compressor projections and
  the indexer's `weights_proj` (transformers' `_keep_in_fp32_modules` list);
- FP32: norms, `hc_*`, sinks, `ape`, the router bias (`_keep_in_fp32_modules_strict`); `tid2eid` int.

Mapping to MLX is lossless and keeps the bytes: FP4 experts are MLX `mxfp4` as they are (the packed
bytes read as uint32 are MLX's nibble order); an FP8 block is 4 × 32 MLX `mxfp8` groups per row, so
each block scale is repeated (128 rows × 4 groups).
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np

from tessera.engine.model.fp_formats import (
    E2M1_VALUES, E4M3_MAX, decode_e4m3, decode_e8m0, e8m0_for, encode_e4m3, unpack_e2m1,
)
from tessera.engine.model.quantized import QuantizedWeight

BLOCK = 128  # FP8 block edge (quantization_config.weight_block_size)
FP4_GROUP = 32  # FP4 inputs per scale
MX_GROUP = 32  # MLX's mx-format group size

QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [BLOCK, BLOCK]}

_FP8 = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
_FP4 = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP32 = re.compile(r"(norm\.weight|hc_\w+|attn_sink|\.ape|gate\.bias)$")


def storage(name: str) -> str:
    """How the official format stores tensor `name`: "fp8", "fp4", "bf16", "fp32" or "int"."""
    if _FP8.match(name):
        return "fp8"
    if _FP4.match(name):
        return "fp4"
    if name.endswith("tid2eid"):
        return "int"
    if _FP32.search(name):
        return "fp32"
    return "bf16"


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))


def fp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (shape[0], shape[1] // FP4_GROUP)


class FormatError(ValueError):
    """A shape the official format (as transformers reads it) cannot hold."""


def check_fp8_shape(name: str, shape: tuple[int, ...]) -> None:
    """transformers derives the FP8 block from the scale grid: exact only for dimensions ≤ BLOCK or multiples of it."""
    for size in shape:
        if size > BLOCK and size % BLOCK:
            raise FormatError(f"tensor {name!r} {shape}: FP8 needs each dimension ≤ {BLOCK} or a multiple of {BLOCK}")


def check_fp4_shape(shape: tuple[int, ...]) -> None:
    if shape[-1] % FP4_GROUP:
        raise FormatError(f"FP4 experts need the input dimension to be a multiple of {FP4_GROUP}; got {shape}")


def fp4_base_exponent(cols: int) -> int:
    """The biased E8M0 exponent that puts a uniform random nibble's RMS near 1/sqrt(cols) (random experts)."""
    rms_code = float(np.sqrt(np.mean(E2M1_VALUES**2)))  # of a uniform nibble
    return 127 + int(round(-np.log2(rms_code * np.sqrt(cols))))


# ---- writing (make-model --format official) -----------------------------------------------------


def quantize_fp8(name: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (E4M3 codes [out, in] uint8, E8M0 block scales [ceil(out/128), ceil(in/128)])."""
    rows, cols = w.shape
    check_fp8_shape(name, w.shape)
    sr, sc = fp8_scale_shape(w.shape)
    br, bc = min(rows, BLOCK), min(cols, BLOCK)
    blocks = w.reshape(sr, br, sc, bc)
    scale = e8m0_for(np.abs(blocks).max(axis=(1, 3)), E4M3_MAX)  # [sr, sc]
    codes = encode_e4m3(blocks / decode_e8m0(scale)[:, None, :, None])
    return codes.reshape(rows, cols), scale


def random_fp4(shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random FP4 expert weight [out, in] drawn directly as codes (fast at V4 Flash widths):
    uniform nibbles, per-group scales near 1/sqrt(in) with a ±1 exponent jitter."""
    rows, cols = shape
    check_fp4_shape(shape)
    packed = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8).view(np.int8)
    scale = (fp4_base_exponent(cols) + rng.integers(-1, 2, size=(rows, cols // FP4_GROUP))).astype(np.uint8)
    return packed, scale


# ---- reading ------------------------------------------------------------------------------------


def dequantize_fp8(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight transformers computes (code × its block's 2^e)."""
    rows, cols = codes.shape
    s = decode_e8m0(scale)
    full = np.repeat(np.repeat(s, BLOCK, axis=0)[:rows], BLOCK, axis=1)[:, :cols]
    return decode_e4m3(codes) * full


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    values = unpack_e2m1(packed)
    return values * np.repeat(decode_e8m0(scale), FP4_GROUP, axis=1)


def mxfp8_from_blocks(codes: np.ndarray, scale: np.ndarray) -> QuantizedWeight | None:
    """E4M3 [out, in] + 128×128 E8M0 -> MLX mxfp8 (group 32); None where in % 32 != 0 (MLX cannot)."""
    rows, cols = codes.shape
    if cols % MX_GROUP:
        return None
    repeated = np.repeat(np.repeat(scale, BLOCK, axis=0)[:rows], BLOCK // MX_GROUP, axis=1)[:, : cols // MX_GROUP]
    values = mx.array(np.ascontiguousarray(codes).view(np.uint32))  # 4 codes per word, first in the low byte
    return QuantizedWeight(values, mx.array(np.ascontiguousarray(repeated)), None, "mxfp8", 8, MX_GROUP)


def mxfp4_from_packed(packed: np.ndarray, scale: np.ndarray) -> QuantizedWeight | None:
    """Packed E2M1 [out, in/2] + E8M0 [out, in/32] -> MLX mxfp4 (same bytes); None where MLX cannot."""
    if packed.shape[1] % 4:
        return None
    values = mx.array(np.ascontiguousarray(packed).view(np.uint32))
    return QuantizedWeight(values, mx.array(np.ascontiguousarray(scale)), None, "mxfp4", 4, FP4_GROUP)
