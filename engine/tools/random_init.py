"""Random initial values for one checkpoint tensor, shared by the plain and the official-format writers.

Every parameter and buffer gets a value at a scale that keeps activations O(1): transformers' default
init leaves norms at 1, sinks/biases/`ape` at 0 and `tid2eid` all zeros, which hides bugs.
"""

from __future__ import annotations

import numpy as np

from engine.model.config import ModelConfig


def random_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if name.endswith("gate.tid2eid"):  # distinct experts per token
        return np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=1)[:, : shape[1]].astype(np.int64)
    if name == "embed.weight":
        return rng.standard_normal(shape, dtype=np.float32)
    if leaf in ("norm", "q_norm", "attn_norm", "ffn_norm") or name == "norm.weight":
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith(("_scale",)):
        return (1.0 + 0.2 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith(("_base", "attn_sink", ".ape", "gate.bias")):
        return (0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    fan_in = shape[-1]
    return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)
