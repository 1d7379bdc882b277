"""How a random-weight V4 model draws each tensor: one rule per tensor name, shared by the checkpoint
writers (numpy, engine/tools/random_init.py) and the in-memory generator (MLX, on the device,
engine/model/random_weights.py), so both give activations of the same magnitude.

Every parameter and buffer gets a value at a scale that keeps activations O(1): transformers' default
init leaves norms at 1, sinks/biases/`ape` at 0 and `tid2eid` all zeros, which hides bugs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InitRule:
    kind: str  # "normal": offset + std · N(0, 1); "fan_in": N(0, 1) / sqrt(in); "tid2eid": distinct experts per token
    offset: float = 0.0
    std: float = 1.0


def init_rule(name: str) -> InitRule:
    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if name.endswith("gate.tid2eid"):
        return InitRule("tid2eid")
    if name == "embed.weight":
        return InitRule("normal", 0.0, 1.0)
    if leaf in ("norm", "q_norm", "attn_norm", "ffn_norm") or name == "norm.weight":
        return InitRule("normal", 1.0, 0.1)
    if name.endswith("_scale"):
        return InitRule("normal", 1.0, 0.2)
    if name.endswith(("_base", "attn_sink", ".ape", "gate.bias")):
        return InitRule("normal", 0.0, 0.5)
    return InitRule("fan_in")
