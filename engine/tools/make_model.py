"""`tessera make-model`: write a random-weight V4 checkpoint that Tessera and transformers both load.

Every parameter and buffer is randomized at a scale that keeps activations O(1) — transformers'
default init leaves norms at 1, sinks/biases/`ape` at 0 and `tid2eid` all zeros, which hides bugs
(docs/ARCHITECTURE.md). Same preset, overrides and seed -> byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tessera.engine.model.config import CSA, HCA, V4_FLASH, WINDOW, ModelConfig, config_from_dict
from tessera.engine.model.dtypes import DTYPES
from tessera.engine.model.weights import expected_shapes
from tessera.engine.tools.random_init import random_value

_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds-fast equivalence tests: every layer type, hash and learned routing.
    "tiny": dict(
        vocab_size=2048, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=16,
        n_routed_experts=4, num_experts_per_tok=2, index_n_heads=32, index_head_dim=32, index_topk=16,
        layer_types=[WINDOW, CSA, HCA, CSA], num_hash_layers=2, max_position_embeddings=65536,
    ),
    # CPU benchmarks at 32k–64k context: V4 ratios, window and top-k; narrow everywhere else.
    "small": dict(
        vocab_size=2048, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=6, num_attention_heads=8,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, sliding_window=128,
        n_routed_experts=8, num_experts_per_tok=2, index_n_heads=16, index_head_dim=64, index_topk=512,
        layer_types=[WINDOW, WINDOW, CSA, HCA, CSA, HCA], num_hash_layers=2, max_position_embeddings=1048576,
    ),
    # V4 Flash attention and indexer dimensions with few layers and a small MoE (GPU memory benchmarks).
    "flash-attn": dict(
        vocab_size=2048, hidden_size=4096, moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        n_routed_experts=8, num_experts_per_tok=2, index_n_heads=64, index_head_dim=128, index_topk=512,
        layer_types=[WINDOW, CSA, HCA, CSA], num_hash_layers=1, max_position_embeddings=1048576,
    ),
    # Every V4 Flash width real (hidden, 256 experts top-6 + shared, heads, indexer, vocab) with 4 layers
    # instead of 43, so per-layer prefill and decode numbers extrapolate to the whole model.
    "flash-width": dict(
        vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        n_routed_experts=256, num_experts_per_tok=6, index_n_heads=64, index_head_dim=128, index_topk=512,
        layer_types=[WINDOW, CSA, HCA, CSA], num_hash_layers=1, max_position_embeddings=1048576,
    ),
    # DeepSeek-V4-Flash itself: 43 layers (2 window, then CSA/HCA alternating; 3 hash-routed), every width
    # real (engine/model/config.py's V4_FLASH). Official format only as a random-weights directory
    # (`--format official --in-memory`): its ~149 GiB are made on the device at load, not written.
    "v4-flash": {k: v for k, v in V4_FLASH.items() if k not in ("model_type", "rope_scaling")},
}


def preset_config(preset: str, **overrides: Any) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    raw: dict[str, Any] = {"model_type": "deepseek_v4", "rope_scaling": dict(_YARN), **PRESETS[preset]}
    layers = overrides.pop("layers", None)
    raw.update(overrides)
    if layers is not None:  # --layers L: first two window-only as V4, then CSA/HCA alternating
        pattern = [WINDOW] * min(layers, 1) + [CSA if i % 2 == 0 else HCA for i in range(max(layers - 1, 0))]
        raw["layer_types"], raw["num_hidden_layers"] = pattern, layers
        raw["num_hash_layers"] = min(raw.get("num_hash_layers", 1), layers)
    return config_from_dict(raw)


def write_random_weights_dir(out_dir: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """config.json (as an official checkpoint's) + random_weights.json; no weight files."""
    from tessera.engine.model.random_weights import RandomWeightsSpec, write_spec
    from tessera.engine.tools.official_checkpoint import write_official_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_official_config(out_dir, cfg)
    write_spec(out_dir, RandomWeightsSpec("official", seed))
    return out_dir


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: random_value(name, shape, cfg, rng) for name, shape in expected_shapes(cfg).items()}


def write_checkpoint(out_dir: Path, cfg: ModelConfig, seed: int = 0, dtype: str = "float32") -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = DTYPES[dtype]
    tensors = {}
    for name, value in random_weights(cfg, seed).items():
        arr = mx.array(value)
        tensors[name] = arr.astype(target) if value.dtype == np.float32 else arr
    mx.save_safetensors(str(out_dir / "model.safetensors"), tensors, metadata={"format": "pt"})
    config = cfg.to_transformers_dict()
    config["dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def make_model(out_dir: Path, preset: str = "tiny", seed: int = 0, with_tokenizer: bool = True, dtype: str = "float32",
               fmt: str = "plain", config_file: Path | None = None, in_memory: bool = False, **overrides: Any) -> Path:
    """fmt: "plain" (every tensor in `dtype`) or "official" (DeepSeek's FP8/FP4, see
    engine/tools/official_checkpoint.py). config_file: a DeepSeek V4 config.json instead of a preset.
    in_memory (official only): write no weights, only config.json and random_weights.json: the loader
    makes the random official-format arrays on the device (engine/model/random_weights.py)."""
    cfg = config_from_dict(json.loads(Path(config_file).read_text())) if config_file else preset_config(preset, **overrides)
    if in_memory:
        if fmt != "official":
            raise ValueError("--in-memory makes official-format weights: use it with --format official")
        write_random_weights_dir(out_dir, cfg, seed)
    elif fmt == "official":
        from tessera.engine.tools.official_checkpoint import write_official_checkpoint

        write_official_checkpoint(out_dir, cfg, seed)
    else:
        write_checkpoint(out_dir, cfg, seed, dtype)
    if with_tokenizer:
        from tessera.engine.tools.tokenizer_train import train_tokenizer

        # a random-weights model may be V4 Flash's size: its vocabulary is padded past what the corpus trains
        train_tokenizer(Path(out_dir), vocab_size=cfg.vocab_size, seed=seed, pad=in_memory)
    return Path(out_dir)
