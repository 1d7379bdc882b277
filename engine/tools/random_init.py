"""Random initial values for one checkpoint tensor, shared by the plain and the official-format writers.
The rule per tensor (scale, offset) is engine/model/init_rules.py's, which the in-memory generator
(engine/model/random_weights.py) follows too.
"""

from __future__ import annotations

import numpy as np

from tessera.engine.model.config import ModelConfig
from tessera.engine.model.init_rules import init_rule


def random_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    rule = init_rule(name)
    if rule.kind == "tid2eid":  # distinct experts per token
        return np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=1)[:, : shape[1]].astype(np.int64)
    if rule.kind == "fan_in":
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
    value = rng.standard_normal(shape, dtype=np.float32)
    if rule.std != 1.0:
        value = rule.std * value
    if rule.offset != 0.0:
        value = rule.offset + value
    return value.astype(np.float32)
