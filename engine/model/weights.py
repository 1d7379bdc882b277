"""The V4 checkpoint's tensor names and shapes, in the official spelling (`layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, `hc_head_fn`, `head.weight`, …).

One table serves the loader (what must be there, with which shape), `make-model` (what to write)
and the memory plan (how many bytes the weights are).
"""

from __future__ import annotations

import re

import mlx.core as mx

from tessera.engine.model.config import CSA, HASH_MOE, ModelConfig

# transformers' `save_pretrained` leaves these in its own spelling (its renames are anchored at the
# start of the name, after which it adds `model.`); map them back to the official names.
_ALIASES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def canonical_name(name: str) -> str:
    """Official spelling of a checkpoint tensor name (accepts a `model.` prefix)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    return _ALIASES.get(name, name)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` holds, name -> shape (official names, experts unstacked)."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, d),
        "head.weight": (cfg.vocab_size, d),
        "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for i in range(cfg.num_hidden_layers):
        shapes.update(_layer_shapes(cfg, i))
    return shapes


def _layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    d, hc, hd = cfg.hidden_size, cfg.hc_mult, cfg.head_dim
    p = f"layers.{i}."
    mix = (2 + hc) * hc
    s: dict[str, tuple[int, ...]] = {
        p + "attn_norm.weight": (d,),
        p + "ffn_norm.weight": (d,),
        p + "hc_attn_fn": (mix, hc * d),
        p + "hc_attn_base": (mix,),
        p + "hc_attn_scale": (3,),
        p + "hc_ffn_fn": (mix, hc * d),
        p + "hc_ffn_base": (mix,),
        p + "hc_ffn_scale": (3,),
        p + "attn.wq_a.weight": (cfg.q_lora_rank, d),
        p + "attn.q_norm.weight": (cfg.q_lora_rank,),
        p + "attn.wq_b.weight": (cfg.num_attention_heads * hd, cfg.q_lora_rank),
        p + "attn.wkv.weight": (hd, d),
        p + "attn.norm.weight": (hd,),
        p + "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, cfg.num_attention_heads * hd // cfg.o_groups),
        p + "attn.wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank),
        p + "attn.attn_sink": (cfg.num_attention_heads,),
    }
    ratio = cfg.compress_ratio(i)
    if ratio:
        width = 2 * hd if cfg.is_overlapping(i) else hd
        s.update(_compressor_shapes(p + "attn.compressor.", d, width, hd, ratio))
    if cfg.layer_types[i] == CSA:
        idx = cfg.index_head_dim
        s.update(_compressor_shapes(p + "attn.indexer.compressor.", d, 2 * idx, idx, ratio))
        s[p + "attn.indexer.wq_b.weight"] = (cfg.index_n_heads * idx, cfg.q_lora_rank)
        s[p + "attn.indexer.weights_proj.weight"] = (cfg.index_n_heads, d)
    s.update(_moe_shapes(cfg, i))
    return s


def _compressor_shapes(p: str, d: int, width: int, head_dim: int, ratio: int) -> dict[str, tuple[int, ...]]:
    return {p + "wkv.weight": (width, d), p + "wgate.weight": (width, d), p + "ape": (ratio, width), p + "norm.weight": (head_dim,)}


def _moe_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    p = f"layers.{i}.ffn."
    shared = inter  # transformers sizes the shared expert by moe_intermediate_size alone
    s: dict[str, tuple[int, ...]] = {
        p + "gate.weight": (cfg.n_routed_experts, d),
        p + "shared_experts.w1.weight": (shared, d),
        p + "shared_experts.w2.weight": (d, shared),
        p + "shared_experts.w3.weight": (shared, d),
    }
    if cfg.mlp_layer_types[i] == HASH_MOE:
        s[p + "gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        s[p + "gate.bias"] = (cfg.n_routed_experts,)
    for e in range(cfg.n_routed_experts):
        s[p + f"experts.{e}.w1.weight"] = (inter, d)
        s[p + f"experts.{e}.w2.weight"] = (d, inter)
        s[p + f"experts.{e}.w3.weight"] = (inter, d)
    return s


# Tensors held in one dtype whatever the checkpoint's or the compute dtype (deepseek_v4._hold_fixed_dtypes, at load):
# the norms' weights, the router and its bias in float32 (what the norms weigh and the routing scores multiply in),
# the hash layers' token -> expert table in uint32 (the expert ids' dtype: the top-k's, the expert kernels'). By name
# suffix.
_HELD_DTYPES = {"norm.weight": mx.float32, "ffn.gate.weight": mx.float32, "ffn.gate.bias": mx.float32,
                "ffn.gate.tid2eid": mx.uint32}


def held_dtype(name: str) -> mx.Dtype | None:
    """The dtype the loaded model holds `name` in, where fixed (None: the compute dtype or the format's)."""
    return next((dtype for suffix, dtype in _HELD_DTYPES.items() if name.endswith(suffix)), None)


def held_itemsize(name: str) -> int | None:
    """Bytes per value of `held_dtype(name)` (None where it is not fixed)."""
    dtype = held_dtype(name)
    return None if dtype is None else dtype.size


_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


def expert_key(name: str) -> tuple[str, int] | None:
    """`layers.3.ffn.experts.7.w1.weight` -> ("layers.3.ffn.experts.w1", 7); None for other names."""
    m = _EXPERT.match(name)
    return (f"{m.group(1)}.{m.group(3)}", int(m.group(2))) if m else None


def stacked_expert_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """`layers.N.ffn.experts.wK` (one [E, out, in] array, as the loader holds it and `tessera convert`
    writes it) -> its per-expert checkpoint names in expert order."""
    out: dict[str, list[str]] = {}
    for i in range(cfg.num_hidden_layers):
        for w in ("w1", "w2", "w3"):
            out[f"layers.{i}.ffn.experts.{w}"] = [f"layers.{i}.ffn.experts.{e}.{w}.weight" for e in range(cfg.n_routed_experts)]
    return out


_LAYER = re.compile(r"^layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """`layers.3.attn.wkv.weight` -> 3; None for the model-wide tensors (embedding, head, final norms)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None
