"""`tessera convert SRC DST --quant affine4|affine8|mxfp4 [--group-size G] [--dense]`: rewrite a
checkpoint (plain, official FP8/FP4, or an earlier conversion) as an MLX-native quantized one.

The routed experts (most of V4's bytes) are always requantized; `--dense` also requantizes the
projections the official format keeps in FP8 (attention, indexer `wq_b`, shared expert). Everything
else keeps its stored dtype. Quantized tensors are written as MLX holds them: `<name>` uint32 values,
`<name>.scales` (uint8 E8M0 for mx formats, float for affine) and `<name>.biases` (affine); experts
stacked per layer as `layers.N.ffn.experts.wK` [E, out, in]. engine/model/loader.py reads them back.

The source is streamed (loader.iter_weights): memory holds one layer's experts and one output shard,
not the model, so a checkpoint can be converted on the machine it is meant to fit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from tessera.engine.model.loader import iter_weights
from tessera.engine.model.official_format import storage
from tessera.engine.model.quantized import QuantizedWeight, Weight, quantize
from tessera.engine.model.safetensors_file import ShardedWriter

QUANTS = ("affine4", "affine8", "mxfp4")
DEFAULT_GROUP = {"affine4": 64, "affine8": 64, "mxfp4": 32}
_TAGS = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int64: "I64", mx.int32: "I32", mx.uint32: "U32", mx.uint8: "U8"}


class ConvertError(ValueError):
    """A conversion that cannot be done as asked; the message names the flag or tensor."""


@dataclass(frozen=True)
class ConvertReport:
    source: str
    destination: str
    quant: str
    group_size: int
    dense: bool
    bytes_before: int
    bytes_after: int

    def as_dict(self) -> dict:
        return asdict(self) | {"ratio": round(self.bytes_after / self.bytes_before, 4)}


def convert(src: Path, dst: Path, quant: str, group_size: int | None = None, dense: bool = False,
            shard_bytes: int = 4 * 2**30) -> ConvertReport:
    if quant not in QUANTS:
        raise ConvertError(f"--quant: {quant!r} is not one of {', '.join(QUANTS)}")
    group = group_size or DEFAULT_GROUP[quant]
    if quant == "mxfp4" and group != 32:
        raise ConvertError(f"--group-size: mxfp4 groups are 32 values (one E8M0 scale each); got {group}")
    if group not in (32, 64, 128):
        raise ConvertError(f"--group-size: MLX quantizes in groups of 32, 64 or 128; got {group}")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(dst, shard_bytes)
    for name, w in iter_weights(src):  # streamed: one tensor (one layer's experts) in memory at a time
        target = _requantize(name, w, quant, group) if _selected(name, dense) else w
        for key, tag, array in _stored(name, target):
            writer.add(key, tag, array)
        del w, target
    written = writer.close()
    _write_config(src, dst, quant, group, dense)
    before = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    return ConvertReport(str(src), str(dst), quant, group, dense, before, written)


def _selected(name: str, dense: bool) -> bool:
    if ".ffn.experts.w" in name:  # stacked experts
        return True
    return dense and storage(name) == "fp8"


def _requantize(name: str, w: Weight, quant: str, group: int) -> QuantizedWeight:
    if isinstance(w, QuantizedWeight) and w.mode == quant == "mxfp4" and w.group_size == group:
        return w  # official FP4 experts are already mxfp4 in groups of 32: the bytes stay
    if w.shape[-1] % group:
        raise ConvertError(f"tensor {name!r} {w.shape}: input dimension is not a multiple of --group-size {group}")
    # FP8/FP4 values are exact in bf16, and bf16 affine scales/biases are what the plan counts;
    # a plain source keeps its own dtype (fp32 weights get fp32 scales)
    full = w.dequantize(mx.bfloat16) if isinstance(w, QuantizedWeight) else w
    q = quantize(full, quant, group)
    mx.eval(q.arrays())
    return q


def _stored(name: str, w: Weight) -> list[tuple[str, str, np.ndarray]]:
    if isinstance(w, QuantizedWeight):
        out = [(name, "U32", _numpy(w.values)), (name + ".scales", _TAGS[w.scales.dtype], _numpy(w.scales))]
        if w.biases is not None:
            out.append((name + ".biases", _TAGS[w.biases.dtype], _numpy(w.biases)))
        return out
    return [(name, _TAGS[w.dtype], _numpy(w))]


def _numpy(a: mx.array) -> np.ndarray:
    """The array's bytes as numpy (bf16 as its uint16 bit patterns, numpy has no bf16)."""
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def _write_config(src: Path, dst: Path, quant: str, group: int, dense: bool) -> None:
    config = json.loads((src / "config.json").read_text())
    # transformers cannot read MLX-packed tensors: drop the FP8 description so nothing mistakes them
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    config["tessera_quantization"] = {"experts": quant, "dense": quant if dense else "as source", "group_size": group}
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).is_file():
            (dst / extra).write_bytes((src / extra).read_bytes())
