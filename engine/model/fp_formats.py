"""The small float formats of DeepSeek V4's official checkpoints, in numpy (numpy has none of them):
FP8 E4M3 (dense weights), FP4 E2M1 packed two per byte (routed experts), E8M0 power-of-two scales.

Decoding is a lookup table over the byte; encoding (for `make-model --format official`) rounds to
the nearest representable value. Both agree with torch's `float8_e4m3fn` / `float8_e8m0fnu` and
with transformers' FP4 table (integrations/finegrained_fp8.py), which tests/test_official_format.py
checks byte for byte.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E4M3_MAX = 448.0
E2M1_MAX = 6.0


def _e4m3_table() -> np.ndarray:
    """All 256 E4M3 (fn: no infinities, 0x7F/0xFF are NaN) codes -> float32."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = (man / 8.0) * np.exp2(-6.0)
    values = sign * np.where(exp == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[codes.astype(np.uint8)]


def decode_e8m0(codes: np.ndarray) -> np.ndarray:
    """E8M0 byte b -> 2^(b - 127) (b = 255 is NaN), built from float32 bits so it is exact."""
    b = codes.astype(np.uint32)
    bits = np.where(b == 0, np.uint32(0x00400000), b << np.uint32(23))  # 2^-127 is subnormal
    bits = np.where(b == 255, np.uint32(0x7FC00000), bits)
    return bits.astype(np.uint32).view(np.float32)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """[..., n/2] bytes -> [..., n] float32; the low nibble is the even element (transformers' order)."""
    u8 = packed.view(np.uint8)
    pairs = np.stack([E2M1_VALUES[u8 & 0xF], E2M1_VALUES[u8 >> 4]], axis=-1)
    return pairs.reshape(*u8.shape[:-1], 2 * u8.shape[-1])


def _nearest_code(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest finite non-negative table entry to |x|, with x's sign in the top bit."""
    half = len(table) // 2
    magnitudes = table[:half]
    finite = np.flatnonzero(np.isfinite(magnitudes))
    order = finite[np.argsort(magnitudes[finite], kind="stable")]
    sorted_mag = magnitudes[order]
    a = np.abs(x)
    hi = np.clip(np.searchsorted(sorted_mag, a), 1, len(sorted_mag) - 1)
    lo = hi - 1
    pick = np.where(a - sorted_mag[lo] <= sorted_mag[hi] - a, lo, hi)
    code = order[pick].astype(np.uint8)
    return np.where(np.signbit(x), code | np.uint8(half), code).astype(np.uint8)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float -> nearest E4M3 code (values beyond ±448 saturate). MLX's converter: ~30× numpy's
    table search, which matters at V4 Flash widths."""
    clipped = mx.clip(mx.array(x, dtype=mx.float32), -E4M3_MAX, E4M3_MAX)
    return np.array(mx.to_fp8(clipped))


def pack_e2m1(x: np.ndarray) -> np.ndarray:
    """[..., n] float -> [..., n/2] int8, nearest E2M1 value, two per byte (low nibble first)."""
    codes = _nearest_code(np.clip(x, -E2M1_MAX, E2M1_MAX).astype(np.float32), E2M1_VALUES)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8).view(np.int8)


def e8m0_for(amax: np.ndarray, format_max: float) -> np.ndarray:
    """The power-of-two scale code (E8M0) that brings `amax` within the format's range."""
    exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / format_max))
    return np.clip(exponent + 127, 0, 254).astype(np.uint8)
