"""Quantized weights as MLX holds them, and the one matmul helper every projection call site uses.

A `QuantizedWeight` is MLX's packed form (`mx.quantize`'s output): `values` uint32, `scales`
(uint8 E8M0 for `mxfp4`/`mxfp8`; float for `affine`), `biases` (affine only). `linear(x, w)` is
`x @ w.T` for a plain array and `mx.quantized_matmul` for a quantized one, so the model code does
not branch on the format. A projection over many rows (prefill) dequantizes the weight for that batch
and runs a dense matmul instead (`dense_min_rows`, TESSERA_DENSE_MIN_ROWS).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from tessera.kernels import mxfp8_qmv

# mode -> bits MLX packs per value
MODES: dict[str, int] = {"mxfp4": 4, "mxfp8": 8, "affine4": 4, "affine8": 8}


@dataclass(frozen=True)
class QuantizedWeight:
    values: mx.array  # uint32 [..., out, in · bits / 32]
    scales: mx.array  # [..., out, in / group_size]
    biases: mx.array | None  # affine only, like scales
    mode: str  # "mxfp4" | "mxfp8" | "affine"
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        *lead, packed = self.values.shape
        return (*lead, packed * 32 // self.bits)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes + (self.biases.nbytes if self.biases is not None else 0)

    def arrays(self) -> list[mx.array]:
        return [self.values, self.scales] + ([self.biases] if self.biases is not None else [])

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        out = mx.dequantize(self.values, self.scales, self.biases, group_size=self.group_size, bits=self.bits, mode=self.mode)
        return out.astype(dtype)

    def grouped(self, groups: int) -> "QuantizedWeight":
        """[out, in] -> [groups, out / groups, in] (views of the packed arrays), made once per weight and group
        count: the output projection of every layer of every decode step uses them (four graph nodes each)."""
        made = self.__dict__.setdefault("_grouped", {})  # a frozen dataclass's own cache, outside its fields
        if groups not in made:
            split = lambda a: None if a is None else a.reshape(groups, -1, a.shape[-1])  # noqa: E731
            made[groups] = QuantizedWeight(split(self.values), split(self.scales), split(self.biases), self.mode,
                                           self.bits, self.group_size)
            mx.eval(made[groups].arrays())
        return made[groups]

    def with_float_dtype(self, dtype: mx.Dtype) -> "QuantizedWeight":
        """Affine scales/biases follow the compute dtype (E8M0 scales are bytes and stay)."""
        if self.mode != "affine":
            return self
        return QuantizedWeight(self.values, self.scales.astype(dtype), self.biases.astype(dtype), self.mode, self.bits, self.group_size)


Weight = mx.array | QuantizedWeight

# A projection over at least dense_min_rows() rows dequantizes its weight (transiently: for one batch, never a
# resident float copy) and runs a dense matmul; fewer rows (decode, short chunks) run quantized_matmul on
# the packed weight. quantized_matmul reads ~2-4x fewer bytes, which is what decode is bound by, but with
# many rows the product is compute-bound and the quantized gemm kernels are slower than the dense one
# (the H200 prefilled 0.61x as fast as bf16 with quantized_matmul at 4096 rows, docs/BENCHMARKS.md
# "Issue 13"); the dequantization, one pass over the weight, is then small next to the gemm. Callers that
# split a batch into blocks decide once by the batch's rows (`for_rows`), so a row's result never depends
# on how the batch is tiled. It can depend on the batch's size, in the last bits: the two paths sum in a
# different order, so a quantized model's row computed in a step below and in one above the threshold
# (a short last chunk, a resumed prefix, decode beside a large prefill) differs by ~1e-6 of the largest output (float32) —
# bit-identity across batch compositions holds for plain weights only (a GPU gemm's never does anyway).
#
# TESSERA_DENSE_MIN_ROWS=N (environment, a positive integer) moves the threshold, for a device whose
# quantized matmul is the slow path at fewer rows: on the CPU the dense path was ahead from ~16 rows
# (docs/BENCHMARKS.md, "Issue 13"). Not on an H200: there MLX 0.32's mxfp8 GEMM (qmm_sm80, from 8 rows) is
# slow at decode batch sizes (~2.8 ms of a batch-16 step's ~9.6 ms of kernel time), but its CUDA dequantize
# is slower still: dequantize + matmul lost to quantized_matmul at 16 rows for every projection
# (`quant_bench --matmul`, docs/BENCHMARKS.md, "Session 14 on the H200"), so 256 stays there.
DENSE_MIN_ROWS_ENV = "TESSERA_DENSE_MIN_ROWS"
DEFAULT_DENSE_MIN_ROWS = 256


def _rows_from_env() -> int:
    value = os.environ.get(DENSE_MIN_ROWS_ENV, str(DEFAULT_DENSE_MIN_ROWS))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DENSE_MIN_ROWS_ENV} must be a positive integer (rows), got {value!r}")
    return int(value)


_dense_min_rows = _rows_from_env()


def dense_min_rows() -> int:
    """Rows from which a projection dequantizes its weight for the step (TESSERA_DENSE_MIN_ROWS, default 256)."""
    return _dense_min_rows


def set_dense_min_rows(rows: int) -> None:
    """Moves the threshold for every later step (benchmarks' A B B A comparisons)."""
    global _dense_min_rows
    if rows < 1:
        raise ValueError(f"dense_min_rows must be at least 1, got {rows}")
    _dense_min_rows = int(rows)


def quantize(w: mx.array, mode: str, group_size: int) -> QuantizedWeight:
    """mode: a MODES key (affine4 / affine8 / mxfp4 / mxfp8)."""
    bits = MODES[mode]
    mlx_mode = "affine" if mode.startswith("affine") else mode
    parts = mx.quantize(w, group_size=group_size, bits=bits, mode=mlx_mode)
    biases = parts[2] if mlx_mode == "affine" else None
    return QuantizedWeight(parts[0], parts[1], biases, mlx_mode, bits, group_size)


def for_rows(w: Weight, rows: int, dtype: mx.Dtype) -> Weight:
    """The weight a projection over a batch of `rows` rows computes with: dequantized to `dtype` at
    `dense_min_rows()` rows or more, else as it is. The result is lazy and lives as long as the caller
    holds it (one layer's step)."""
    if isinstance(w, QuantizedWeight) and rows >= _dense_min_rows:
        return w.dequantize(dtype)
    return w


def linear(x: mx.array, w: Weight) -> mx.array:
    """x: [..., in] -> [..., out] against w: [out, in] (plain or quantized; many rows of x dequantize
    a quantized w for this call, `for_rows`; a decode batch's few rows through an mxfp8 w on CUDA take
    kernels/mxfp8_qmv.py)."""
    rows = x.size // x.shape[-1]
    w = for_rows(w, rows, x.dtype)
    if isinstance(w, QuantizedWeight):
        if _takes_mxfp8_qmv(x.dtype, rows, w):
            out = mxfp8_qmv.mxfp8_qmv_kernel(x.reshape(1, rows, x.shape[-1]), w.values, w.scales)  # [1, rows, out]
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return mx.quantized_matmul(x, w.values, w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits, mode=w.mode)
    return x @ w.T


def prime_grouped_linear(w: Weight, groups: int) -> None:
    """Makes what `grouped_linear(x, w, groups)` caches on its first call (a quantized weight's grouped views, the
    group ids: evaluated as they are made), so that a compiled trace calling it finds them made."""
    if isinstance(w, QuantizedWeight):
        w.grouped(groups)
        _group_ids(groups)


def grouped_linear(x: mx.array, w: Weight, groups: int) -> mx.array:
    """x: [G, B, in] -> [G, B, out / G]: group g through rows [g·out/G, (g+1)·out/G) of w: [out, in]."""
    w = for_rows(w, x.shape[1], x.dtype)
    if isinstance(w, QuantizedWeight):
        split = w.grouped(groups)
        if _takes_mxfp8_qmv(x.dtype, x.shape[1], split):
            return mxfp8_qmv.mxfp8_qmv_kernel(x, split.values, split.scales)
        ids = _group_ids(groups)  # both sides: without lhs_indices MLX makes an Arange node each call
        return mx.gather_qmm(x, split.values, split.scales, split.biases, lhs_indices=ids, rhs_indices=ids,
                             transpose=True, group_size=w.group_size, bits=w.bits, mode=w.mode)
    wg = w.reshape(groups, -1, w.shape[-1])  # [G, out/G, in]
    return x @ wg.transpose(0, 2, 1)


def _takes_mxfp8_qmv(dtype: mx.Dtype, rows: int, w: QuantizedWeight) -> bool:
    """Whether `rows` rows of `dtype` through w run kernels/mxfp8_qmv.py's kernel (CUDA, mxfp8, a decode
    batch's row counts: MLX's GEMM from 8 rows leaves most SMs idle at the narrow projections)."""
    return mxfp8_qmv.is_supported(dtype, rows, w.values, w.mode, w.group_size, w.biases is not None)


@lru_cache(maxsize=8)
def _group_ids(groups: int) -> mx.array:
    """[groups] uint32: group g of x through block g of w (gather_qmm's lhs and rhs indices), made once."""
    ids = mx.arange(groups, dtype=mx.uint32)
    mx.eval(ids)
    return ids


def format_key(w: Weight) -> tuple:
    """Weights with equal keys can be stacked row-wise into one weight (`stacked_rows`): the same storage
    (dtype, or quantization mode, bits, group size and biases) and the same input width."""
    if isinstance(w, QuantizedWeight):
        return ("quantized", w.mode, w.bits, w.group_size, w.biases is None, w.values.ndim, w.values.shape[-1])
    return ("plain", w.dtype, w.ndim, w.shape[-1])


def stacked_rows(ws: list[Weight]) -> Weight:
    """Weights [out_i, in] of one `format_key` -> one [Σ out_i, in] (their rows in order; evaluated). Stacking
    along the output axis keeps every quantization group (they run along the input axis), and each output
    row's sum is the one the weight alone gives it (a row's dot product does not depend on the others)."""
    if len({format_key(w) for w in ws}) != 1:
        raise ValueError("weights of different formats or input widths cannot be stacked")
    first = ws[0]
    if isinstance(first, QuantizedWeight):
        cat = lambda field: None if getattr(first, field) is None else mx.concatenate([getattr(w, field) for w in ws])  # noqa: E731
        out: Weight = QuantizedWeight(cat("values"), cat("scales"), cat("biases"), first.mode, first.bits, first.group_size)
    else:
        out = mx.concatenate(ws)
    mx.eval(weight_arrays(out))
    return out


def row_range(w: Weight, start: int, stop: int) -> Weight:
    """Rows [start, stop) of w [out, in]: a view sharing w's memory (rows of a row-major array are contiguous)."""
    if isinstance(w, QuantizedWeight):
        rows = lambda a: None if a is None else a[start:stop]  # noqa: E731
        out: Weight = QuantizedWeight(rows(w.values), rows(w.scales), rows(w.biases), w.mode, w.bits, w.group_size)
    else:
        out = w[start:stop]
    mx.eval(weight_arrays(out))
    return out


def weight_arrays(w: Weight) -> list[mx.array]:
    """The arrays holding a weight (a quantized one's values, scales and biases)."""
    return w.arrays() if isinstance(w, QuantizedWeight) else [w]


def dequantized(w: Weight, dtype: mx.Dtype) -> mx.array:
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w.astype(dtype)
