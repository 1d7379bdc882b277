"""Random V4 weights in the official format, generated on the device, in memory: no checkpoint files.

V4 Flash in DeepSeek's FP8/FP4 format is ~149 GiB: writing such a checkpoint and reading it back does
not fit a benchmark's minutes (nor a 128 GiB disk). A *random-weights model directory* holds only
`config.json` and `random_weights.json` (`{"format": "official", "seed": S}`, written by
`tessera make-model DIR --format official --in-memory`); `load_model` (engine/model/loader.py) then
builds, for exactly the layers it is asked for, the arrays it would have built from an official
checkpoint of that config:

- FP8 dense projections -> MLX `mxfp8` (group 32) with each 128×128 block's E8M0 scale repeated, as
  `mxfp8_from_blocks` makes them: values drawn N(0, 1/in), scaled per block and rounded to E4M3;
- FP4 routed experts -> MLX `mxfp4`, stacked `[E, out, in]`: uniform E2M1 nibbles and per-32 E8M0
  scales near 1/sqrt(in) with a ±1 exponent jitter (engine/model/official_format.py's `random_fp4`);
- BF16 and FP32 tensors where the format keeps them, `tid2eid` int64 — each at the scale
  engine/model/init_rules.py gives it (the checkpoint writers' rules), so routing, the hyper-connection
  mixing and the softmaxes see activations of a trained-model-like magnitude.

Every tensor's values depend only on (seed, name), never on which layers a process holds: the ranks
of a pipeline hold exactly the slices one process would, so `tessera check parallel` on such a
directory compares like with like. The values are not those of `make-model --format official` with
the same seed (that one draws from numpy's generator on the host).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from tessera.engine.model.config import ModelConfig
from tessera.engine.model.fp_formats import E4M3_MAX
from tessera.engine.model.init_rules import init_rule
from tessera.engine.model.official_format import (
    BLOCK, FP4_GROUP, MX_GROUP, check_fp4_shape, check_fp8_shape, fp4_base_exponent, fp8_scale_shape, storage,
)
from tessera.engine.model.quantized import QuantizedWeight, Weight, weight_arrays
from tessera.engine.model.weights import expected_shapes, expert_key

RANDOM_WEIGHTS_FILE = "random_weights.json"
FORMATS = ("official",)


@dataclass(frozen=True)
class RandomWeightsSpec:
    """What `random_weights.json` says: the format to imitate and the seed."""

    format: str = "official"
    seed: int = 0


def read_spec(model_dir: Path) -> RandomWeightsSpec | None:
    """The directory's random-weights spec, None where it has none (a real checkpoint)."""
    path = Path(model_dir) / RANDOM_WEIGHTS_FILE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    spec = RandomWeightsSpec(format=str(raw.get("format", "official")), seed=int(raw.get("seed", 0)))
    if spec.format not in FORMATS:
        raise ValueError(f"{path}: format {spec.format!r} is not one of {FORMATS}")
    return spec


def write_spec(model_dir: Path, spec: RandomWeightsSpec) -> Path:
    path = Path(model_dir) / RANDOM_WEIGHTS_FILE
    path.write_text(json.dumps({"format": spec.format, "seed": spec.seed}, indent=2) + "\n")
    return path


def random_official_weights(cfg: ModelConfig, seed: int, wanted: Callable[[str], bool] = lambda name: True
                            ) -> Iterator[tuple[str, Weight]]:
    """(name, weight) as the loader yields them from an official checkpoint of `cfg` (experts stacked
    per layer as `layers.N.ffn.experts.wK`), for the tensors `wanted` accepts; each evaluated as it is made."""
    stacked_done: set[str] = set()
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        if not wanted(name):
            continue
        key = expert_key(name)
        if key is not None:
            if key[0] in stacked_done:
                continue
            stacked_done.add(key[0])
            w: Weight = random_fp4_stacked(cfg.n_routed_experts, shape, _key(seed, key[0]))
            name = key[0]
        else:
            w = random_tensor(name, shape, cfg, _key(seed, name))
        mx.eval(weight_arrays(w))
        yield name, w


def _key(seed: int, name: str) -> mx.array:
    return mx.random.key((seed << 32) | zlib.crc32(name.encode()))


def random_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, key: mx.array) -> Weight:
    """One non-expert tensor as the official loader holds it (before any compute-dtype cast)."""
    kind = storage(name)
    if kind == "int":
        return random_tid2eid(shape, cfg.n_routed_experts, key)
    value = random_float(name, shape, key)
    if kind == "fp8":
        return random_fp8(name, value)
    return value.astype(mx.float32 if kind == "fp32" else mx.bfloat16)


def random_float(name: str, shape: tuple[int, ...], key: mx.array) -> mx.array:
    """float32 values at the rule's scale (engine/model/init_rules.py)."""
    rule = init_rule(name)
    normal = mx.random.normal(shape, key=key)
    if rule.kind == "fan_in":
        return normal * (1.0 / math.sqrt(shape[-1]))
    return rule.offset + rule.std * normal


# MLX's GPU sort rejects more than 65,535 rows in one call (docs/BENCHMARKS.md, §4.4); V4's vocabulary is 129,280.
SORT_ROWS = 32768


def random_tid2eid(shape: tuple[int, ...], experts: int, key: mx.array, rows_per_sort: int = SORT_ROWS) -> mx.array:
    """[vocab, top_k] int64: distinct experts per token (a random permutation's first top_k), as the
    writers' `tid2eid`; sorted `rows_per_sort` rows at a time."""
    scores = mx.random.uniform(shape=(shape[0], experts), key=key)
    parts = [mx.argsort(scores[lo : lo + rows_per_sort], axis=1)[:, : shape[1]] for lo in range(0, shape[0], rows_per_sort)]
    return mx.concatenate(parts).astype(mx.int64)


def random_fp8(name: str, value: mx.array) -> Weight:
    """float32 [out, in] -> what the loader makes of its FP8 E4M3 codes + 128×128 E8M0 block scales:
    MLX mxfp8 with each block scale repeated over its 128 rows × 4 groups of 32."""
    rows, cols = value.shape
    check_fp8_shape(name, value.shape)  # the same limit as the checkpoint writer
    sr, sc = fp8_scale_shape(value.shape)
    br, bc = min(rows, BLOCK), min(cols, BLOCK)
    blocks = value.reshape(sr, br, sc, bc)
    amax = mx.abs(blocks).max(axis=(1, 3))  # [sr, sc]
    exponent = mx.clip(mx.ceil(mx.log2(mx.maximum(amax, 1e-30) / E4M3_MAX)), -127, 127)
    codes = mx.to_fp8(mx.clip(blocks / mx.power(2.0, exponent)[:, None, :, None], -E4M3_MAX, E4M3_MAX))
    codes = codes.reshape(rows, cols)  # uint8 E4M3
    scale = (exponent + 127).astype(mx.uint8)  # E8M0 [sr, sc]
    if cols % MX_GROUP:  # MLX cannot hold it quantized: the loader dequantizes such a tensor
        full = mx.repeat(mx.repeat(mx.power(2.0, exponent), BLOCK, axis=0)[:rows], BLOCK, axis=1)[:, :cols]
        return mx.from_fp8(codes, dtype=mx.float32) * full
    repeated = mx.repeat(mx.repeat(scale, BLOCK, axis=0)[:rows], BLOCK // MX_GROUP, axis=1)[:, : cols // MX_GROUP]
    return QuantizedWeight(codes.view(mx.uint32), mx.contiguous(repeated), None, "mxfp8", 8, MX_GROUP)


def random_fp4_stacked(experts: int, shape: tuple[int, ...], key: mx.array) -> QuantizedWeight:
    """A layer's routed experts `[E, out, in]` as the loader stacks them: MLX mxfp4, uniform nibbles,
    per-group E8M0 scales near 1/sqrt(in) (±1 in the exponent), as `random_fp4` draws them on the host."""
    rows, cols = shape
    check_fp4_shape(shape)
    value_key, scale_key = mx.random.split(key)
    packed = mx.random.randint(0, 256, (experts, rows, cols // 2), dtype=mx.uint8, key=value_key)
    jitter = mx.random.randint(-1, 2, (experts, rows, cols // FP4_GROUP), key=scale_key)
    scales = (fp4_base_exponent(cols) + jitter).astype(mx.uint8)
    return QuantizedWeight(packed.view(mx.uint32), scales, None, "mxfp4", 4, FP4_GROUP)
