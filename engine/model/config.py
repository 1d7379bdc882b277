"""DeepSeek-V4 model configuration: one frozen dataclass read from `config.json`.

Two spellings of the same facts exist in the wild and both load here:
- transformers' form: `layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters` {main, compress};
- the official checkpoints' form: `compress_ratios` (0 / 4 / 128 per layer), `num_hash_layers`,
  `rope_scaling` (YaRN for the compressed branches), `qk_rope_head_dim`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

WINDOW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (WINDOW, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
_RATIO_TO_TYPE = {0: WINDOW, 4: CSA, 128: HCA}


# DeepSeek-V4-Flash's config.json (official spelling): 43 layers, 2 window-only then CSA (ratio 4) / HCA
# (ratio 128) alternating, 3 hash-routed MoE layers. `tessera plan`'s default and make-model's `v4-flash` preset.
V4_FLASH = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)], "num_hash_layers": 3,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
}


class ConfigError(ValueError):
    """A config.json that Tessera cannot run; the message names the field."""


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: plain RoPE (`yarn is None`) or YaRN as transformers computes it."""

    theta: float
    dim: int  # rotated channels: the trailing `dim` of each head
    yarn_factor: float | None = None
    yarn_original_max_positions: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    attention_factor: float = 1.0  # cos/sin multiplier; V4 keeps 1.0 for its YaRN table


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    main_rope: RopeSpec = RopeSpec(theta=10000.0, dim=64)
    compress_rope: RopeSpec = RopeSpec(theta=160000.0, dim=64)

    def compress_ratio(self, layer: int) -> int:
        """0 for window-only layers, else the layer's compression ratio."""
        kind = self.layer_types[layer]
        return 0 if kind == WINDOW else self.compress_rates[kind]

    def has_indexer(self, layer: int) -> bool:
        return self.layer_types[layer] == CSA

    def is_overlapping(self, layer: int) -> bool:
        """CSA compressors pool overlapping windows (previous window's Ca half + current Cb half)."""
        return self.layer_types[layer] == CSA

    def rope_for(self, layer: int) -> RopeSpec:
        return self.main_rope if self.layer_types[layer] == WINDOW else self.compress_rope

    def to_transformers_dict(self) -> dict[str, Any]:
        """The config.json transformers' `DeepseekV4Config` reads (and Tessera reads back)."""
        out: dict[str, Any] = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}
        skip = {"main_rope", "compress_rope", "qk_rope_head_dim"}
        for f in fields(self):
            if f.name not in skip:
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        out["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
        out["rope_theta"] = self.main_rope.theta
        out["compress_rope_theta"] = self.compress_rope.theta
        out["rope_parameters"] = {"main": _rope_to_dict(self.main_rope, self), "compress": _rope_to_dict(self.compress_rope, self)}
        out["num_key_value_heads"] = 1
        out["dtype"] = "float32"
        return out


def _rope_to_dict(spec: RopeSpec, cfg: ModelConfig) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_theta": spec.theta, "partial_rotary_factor": spec.dim / cfg.head_dim}
    if spec.yarn_factor is None:
        d["rope_type"] = "default"
        return d
    d.update(
        rope_type="yarn",
        factor=spec.yarn_factor,
        original_max_position_embeddings=spec.yarn_original_max_positions,
        beta_fast=spec.yarn_beta_fast,
        beta_slow=spec.yarn_beta_slow,
        attention_factor=spec.attention_factor,
    )
    return d


# ---- parsing ----------------------------------------------------------------------------------


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type != "deepseek_v4":
        raise ConfigError(f"unknown model_type {model_type!r} in config.json: Tessera runs 'deepseek_v4'")
    known = {f.name for f in fields(ModelConfig)}
    kwargs = {k: raw[k] for k in known if k in raw and k not in _DERIVED}
    n = int(raw.get("num_hidden_layers", ModelConfig.num_hidden_layers))
    head_dim = int(raw.get("head_dim", ModelConfig.head_dim))
    rope_dim = _rope_dim(raw, head_dim)
    kwargs["qk_rope_head_dim"] = rope_dim
    kwargs["compress_rates"] = _compress_rates(raw)
    kwargs["layer_types"] = _layer_types(raw, n)
    kwargs["mlp_layer_types"] = _mlp_layer_types(raw, n)
    kwargs["main_rope"], kwargs["compress_rope"] = _rope_specs(raw, rope_dim)
    if isinstance(kwargs.get("eos_token_id"), list):
        kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
    cfg = ModelConfig(**kwargs)
    _validate(cfg)
    return cfg


_DERIVED = {"layer_types", "mlp_layer_types", "compress_rates", "main_rope", "compress_rope", "qk_rope_head_dim"}


def _rope_dim(raw: dict[str, Any], head_dim: int) -> int:
    if "qk_rope_head_dim" in raw:
        return int(raw["qk_rope_head_dim"])
    factor = raw.get("partial_rotary_factor")
    return int(head_dim * factor) if factor is not None else 64 * head_dim // 512


def _compress_rates(raw: dict[str, Any]) -> dict[str, int]:
    rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
    if "compress_rate_csa" in raw:
        rates[CSA] = int(raw["compress_rate_csa"])
    if "compress_rate_hca" in raw:
        rates[HCA] = int(raw["compress_rate_hca"])
    return {CSA: int(rates[CSA]), HCA: int(rates[HCA])}


def _layer_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])
    elif raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        unknown = [r for r in ratios if r not in _RATIO_TO_TYPE]
        if unknown:
            raise ConfigError(f"compress_ratios: unsupported ratio(s) {unknown}; V4 uses 0, 4 and 128")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    else:  # transformers' default: two HCA layers, then HCA/CSA interleaved
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = types[:n]
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad or len(types) != n:
        raise ConfigError(f"layer_types must list {n} entries from {LAYER_TYPES}; got {types}")
    return tuple(types)


def _mlp_layer_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])[:n]
    else:
        num_hash = int(raw.get("num_hash_layers", raw.get("n_hash_layers", 3)))
        types = [HASH_MOE] * min(n, num_hash) + [MOE] * max(0, n - num_hash)
    bad = [t for t in types if t not in (HASH_MOE, MOE)]
    if bad or len(types) != n:
        raise ConfigError(f"mlp_layer_types must list {n} entries from ('hash_moe', 'moe'); got {types}")
    return tuple(types)


def _rope_specs(raw: dict[str, Any], rope_dim: int) -> tuple[RopeSpec, RopeSpec]:
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return _spec_from_params(params["main"], rope_dim), _spec_from_params(params["compress"], rope_dim)
    main = RopeSpec(theta=float(raw.get("rope_theta", 10000.0)), dim=rope_dim)
    # Official form: `rope_scaling` (YaRN) applies only to the compressed branches, and V4 does not
    # multiply cos/sin by YaRN's mscale (transformers forces attention_factor=1.0 the same way).
    scaling = {k: v for k, v in (raw.get("rope_scaling") or params).items() if k not in ("main", "compress")}
    compress_params = {**scaling, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
    kind = compress_params.get("rope_type", compress_params.get("type", "default"))
    if kind == "yarn":
        compress_params.setdefault("attention_factor", 1.0)
    return main, _spec_from_params(compress_params, rope_dim)


def _spec_from_params(p: dict[str, Any], rope_dim: int) -> RopeSpec:
    kind = p.get("rope_type", p.get("type", "default"))
    theta = float(p.get("rope_theta", 10000.0))
    if kind == "default":
        return RopeSpec(theta=theta, dim=rope_dim)
    if kind != "yarn":
        raise ConfigError(f"rope_parameters: rope_type {kind!r} is not supported (use 'default' or 'yarn')")
    factor = float(p["factor"])
    attention_factor = p.get("attention_factor")
    if attention_factor is None:  # transformers' YaRN default when the key is absent
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return RopeSpec(
        theta=theta,
        dim=rope_dim,
        yarn_factor=factor,
        yarn_original_max_positions=int(p["original_max_position_embeddings"]),
        yarn_beta_fast=float(p.get("beta_fast") or 32.0),
        yarn_beta_slow=float(p.get("beta_slow") or 1.0),
        attention_factor=float(attention_factor),
    )


def _validate(cfg: ModelConfig) -> None:
    if cfg.num_attention_heads * cfg.head_dim % cfg.o_groups:
        raise ConfigError("o_groups must divide num_attention_heads * head_dim")
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.head_dim:
        raise ConfigError(f"qk_rope_head_dim ({cfg.qk_rope_head_dim}) must be even and ≤ head_dim")
    if cfg.scoring_func != "sqrtsoftplus":
        raise ConfigError(f"scoring_func {cfg.scoring_func!r} is not supported (V4 uses 'sqrtsoftplus')")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError("num_experts_per_tok must be ≤ n_routed_experts")
    if cfg.hc_mult < 2:
        # One stream makes every hyper-connection sum (collapse, Sinkhorn) a sum over an axis of size 1,
        # which MLX 0.32.4's shapeless compile crashes on (kernels/shapeless.py): a clear error, not a segfault.
        raise ConfigError(f"hc_mult must be ≥ 2 (got {cfg.hc_mult}): one hyper-connection stream is not supported")
