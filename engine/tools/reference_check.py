"""`tessera check reference`: Tessera's logits against transformers' full forward of the same
checkpoint (the reference is the cache-free forward; transformers' cached CSA decode is known to deviate,
so it is never used here — docs/ARCHITECTURE.md).

Tessera runs the tokens as a user's server would: prefill in chunks of C (indexer tiles of T), then
M single-token decode steps; every logit row is compared with the full forward at that position.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from tessera.engine.model.loader import load_model
from tessera.engine.model.deepseek_v4 import DeepseekV4
from tessera.engine.tools.check_limits import REFERENCE_MAX_ABS_DIFF, REFERENCE_MIN_TOP1_AGREEMENT
from tessera.engine.tools.replay import random_tokens, run_sequence


class ReferenceUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class ReferenceReport:
    num_tokens: int
    chunk: int
    tile: int
    decode: int
    max_abs_diff: float
    prefill_max_abs_diff: float
    decode_max_abs_diff: float
    top1_agreement: float
    worst_position: int

    def as_dict(self) -> dict:
        return asdict(self)

    def failures(self, max_abs_diff: float = REFERENCE_MAX_ABS_DIFF,
                 min_top1_agreement: float = REFERENCE_MIN_TOP1_AGREEMENT) -> list[str]:
        """One line per exceeded threshold (empty: the check passed)."""
        out = []
        if self.max_abs_diff > max_abs_diff:
            out.append(f"max_abs_diff = {self.max_abs_diff} (at position {self.worst_position}) exceeds "
                       f"--max-abs-diff {max_abs_diff}")
        if self.top1_agreement < min_top1_agreement:
            out.append(f"top1_agreement = {self.top1_agreement} is below --min-top1-agreement {min_top1_agreement}")
        return out


def tessera_logits(model: DeepseekV4, tokens: list[int], num_prefill: int, chunk: int, tile: int | None) -> np.ndarray:
    """Prefill tokens[:num_prefill] in chunks, then decode the rest one by one -> [len(tokens), vocab]."""
    return run_sequence(model, tokens, num_prefill, chunk, tile).logits


def reference_logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
    try:
        import torch
        from transformers import DeepseekV4ForCausalLM
    except ImportError as exc:  # the test extra is not installed
        raise ReferenceUnavailable(
            "the reference needs torch and transformers==5.23.0: pip install 'tessera[test]' "
            f"(import failed: {exc})"
        ) from exc
    # An FP8/FP4 checkpoint loads dequantized on the CPU but keeps its BF16 tensors BF16; the cast
    # is exact and makes the whole forward float32.
    try:
        model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).float().eval()
    except ImportError as exc:  # FP8 checkpoints need accelerate in transformers' loader
        raise ReferenceUnavailable(f"transformers cannot load {model_dir}: {exc} (pip install 'tessera[test]')") from exc
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


def compare(ours: np.ndarray, ref: np.ndarray, num_prefill: int, chunk: int, tile: int) -> ReferenceReport:
    diff = np.abs(ours - ref)
    per_position = diff.max(axis=1)
    decode = per_position[num_prefill:]
    return ReferenceReport(
        num_tokens=num_prefill,
        chunk=chunk,
        tile=tile,
        decode=len(decode),
        max_abs_diff=float(per_position.max()),
        prefill_max_abs_diff=float(per_position[:num_prefill].max()) if num_prefill else 0.0,
        decode_max_abs_diff=float(decode.max()) if len(decode) else 0.0,
        top1_agreement=float((ours.argmax(axis=1) == ref.argmax(axis=1)).mean()),
        worst_position=int(per_position.argmax()),
    )


def check_reference(model_dir: Path, num_tokens: int, chunk: int | None = None, tile: int | None = None,
                    decode: int = 0, seed: int = 0, weights_dtype: str | None = None) -> ReferenceReport:
    model = load_model(Path(model_dir), dtype="float32", weights_dtype=weights_dtype)
    tokens = random_tokens(model.cfg.vocab_size, num_tokens + decode, seed)
    chunk = chunk or num_tokens
    ours = tessera_logits(model, tokens, num_tokens, chunk, tile)
    mx.clear_cache()
    ref = reference_logits(Path(model_dir), tokens)
    return compare(ours, ref, num_tokens, chunk, tile or chunk)


@dataclass(frozen=True)
class AgainstReport:
    """A (converted) checkpoint against its source, both run by Tessera on the same tokens."""

    num_tokens: int
    decode: int
    kl_mean: float  # mean over positions of KL(source ‖ model) of the next-token distributions
    kl_max: float
    top1_agreement: float
    max_abs_diff: float

    def as_dict(self) -> dict:
        return asdict(self)


def logit_kl(source: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per row KL(softmax(source) ‖ softmax(other)) in float64."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    ls, lo = log_softmax(source), log_softmax(other)
    return (np.exp(ls) * (ls - lo)).sum(axis=1)


def check_against(model_dir: Path, source_dir: Path, num_tokens: int, chunk: int | None = None, tile: int | None = None,
                  decode: int = 0, seed: int = 0) -> AgainstReport:
    chunk = chunk or num_tokens
    runs = []
    for d in (source_dir, model_dir):
        model = load_model(Path(d), dtype="float32")
        tokens = random_tokens(model.cfg.vocab_size, num_tokens + decode, seed)
        runs.append(tessera_logits(model, tokens, num_tokens, chunk, tile))
        del model
        mx.clear_cache()
    source, ours = runs
    kl = logit_kl(source, ours)
    return AgainstReport(num_tokens, decode, float(kl.mean()), float(kl.max()),
                         float((source.argmax(axis=1) == ours.argmax(axis=1)).mean()), float(np.abs(source - ours).max()))
