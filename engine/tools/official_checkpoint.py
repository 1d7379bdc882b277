"""`make-model --format official`: a random checkpoint in DeepSeek V4's published format (FP8 dense
blocks, FP4 experts, E8M0 scales, BF16/FP32 elsewhere; engine/model/official_format.py), sharded with
an index, with `quantization_config` and `expert_dtype` in config.json — the files transformers 5.23
loads (dequantizing on the CPU) and Tessera loads into MLX quantized arrays.

The float tensors come from make_model's initialiser; FP8 weights are those floats quantized per
128×128 block; FP4 experts are drawn directly as codes (V4 Flash widths hold 6 G expert values).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tessera.engine.model.config import ModelConfig
from tessera.engine.model.official_format import QUANTIZATION_CONFIG, quantize_fp8, random_fp4, storage
from tessera.engine.model.safetensors_file import ShardedWriter
from tessera.engine.model.weights import expected_shapes
from tessera.engine.tools.random_init import random_value

SHARD_BYTES = 4 * 2**30


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def official_tensors(name: str, shape: tuple[int, ...], cfg: ModelConfig, rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    """One checkpoint tensor (+ its `.scale`) as stored: name -> (safetensors dtype tag, bytes-array)."""
    kind = storage(name)
    scale_name = name[: -len(".weight")] + ".scale"
    if kind == "fp4":
        packed, scale = random_fp4(shape, rng)
        return {name: ("I8", packed), scale_name: ("F8_E8M0", scale)}
    value = random_value(name, shape, cfg, rng)
    if kind == "fp8":
        codes, scale = quantize_fp8(name, value)
        return {name: ("F8_E4M3", codes), scale_name: ("F8_E8M0", scale)}
    if kind == "int":
        return {name: ("I64", value.astype(np.int64))}
    if kind == "fp32":
        return {name: ("F32", value.astype(np.float32))}
    return {name: ("BF16", to_bf16_bits(value))}


def write_official_checkpoint(out_dir: Path, cfg: ModelConfig, seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = ShardedWriter(out_dir, shard_bytes)
    for name, shape in expected_shapes(cfg).items():
        for key, (tag, array) in official_tensors(name, shape, cfg, rng).items():
            writer.add(key, tag, array)
    writer.close()
    write_official_config(out_dir, cfg)
    return out_dir


def write_official_config(out_dir: Path, cfg: ModelConfig) -> None:
    config = cfg.to_transformers_dict()
    config["dtype"] = "bfloat16"
    config["expert_dtype"] = "fp4"
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
