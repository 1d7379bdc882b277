"""Does the device compute what the CPU computes? Every other GPU check compares the GPU with itself (tiled
with untiled, decode with prefill, a kernel with its reference); this one compares it with the CPU, on the
same inputs, where nothing discrete can flip: a `tiny`-width model whose every layer is hash-routed (no
learned expert choice) and prompts short enough that a CSA layer's indexer selects every compressed row
(no top-k choice). Each layer runs on both devices from the same input streams (the CPU's output of the
layer before), so a wrong layer shows alone, then the head; then one decoded token the same way, on the caches
each side filled (the batched decode path). What is left is arithmetic: on CUDA, float32
matmuls run on TF32 tensor cores (~1e-3 relative), far inside DEVICE_AGREEMENT_MAX_REL_DIFF
(engine/tools/check_limits.py). Session 8 saw a 1-token prompt's logits differ entirely on the H200
(docs/BENCHMARKS.md, "Session 8 on the H200"; found and fixed in "Session 9": MLX's grouped GEMM inside the
MoE); this is the standing check for it, part of `check gpu` and alone as `check agreement`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment, advance_caches
from tessera.engine.model.loader import load_model
from tessera.engine.model.quantized import QuantizedWeight
from tessera.engine.tools.check_limits import DEVICE_AGREEMENT_MAX_REL_DIFF
from tessera.engine.tools.replay import random_tokens

# Prompt lengths: below and above the CSA ratio (4) and the HCA ratio (32); at 62 tokens a CSA layer has
# 15 compressed rows, within top-k (16), so the indexer keeps them all.
PROMPT_LENGTHS = (1, 5, 31, 62)
LAYER_TYPES = [WINDOW, CSA, HCA, CSA]
# After each prompt one token is decoded: a one-token step takes the decode path (engine/model/decode_attention.py:
# the batched compressors, indexer and row gathers). At 63 tokens a CSA layer has 16 compressed rows, still all
# selected. The decode attention kernel (kernels/decode_attention_cuda.py) runs bf16 and fp16 only, so this float32
# comparison takes its reference; the kernel is held to a float64 evaluation by tests/test_kernels_cuda.py.
DECODE_TOKEN = 7
# The head dim: 256, nearer V4's 512 than the tiny preset's 32 (the products' lengths, and so their rounding, grow
# with it); the comparison measured on the H100 in session 20 ran with it.
HEAD_DIM = 256


# The checkpoint formats compared: every tensor in float32, and DeepSeek's own (FP8 attention, FP4 experts:
# the routed experts run `gather_qmm` instead of `gather_mm`, a different device kernel).
FORMATS = ("plain", "official")


@dataclass(frozen=True)
class AgreementRow:
    checkpoint: str  # a FORMATS entry
    prompt: int  # tokens
    part: str  # "layer 0 (sliding_attention)" … or "logits"
    rel_diff: float  # max |device − CPU| / max |CPU|


# A step of the comparison, run under one device: (model, streams [T, hc, D], segments) -> the output.
Step = Callable[[DeepseekV4, mx.array, list[Segment]], mx.array]


def make_agreement_model(out_dir: Path, fmt: str = "plain") -> Path:
    from tessera.engine.tools.make_model import make_model

    return make_model(Path(out_dir), "tiny", seed=8, with_tokenizer=False, fmt=fmt, layer_types=LAYER_TYPES,
                      num_hidden_layers=len(LAYER_TYPES), num_hash_layers=len(LAYER_TYPES), compress_rates={CSA: 4, HCA: 32},
                      head_dim=HEAD_DIM)


def run_device_agreement(device: mx.Device, log=print) -> list[AgreementRow]:
    """Both checkpoint formats' agreement models, made in a temporary directory, `device` against the CPU."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            with mx.stream(mx.cpu):  # the checkpoint's bytes must not depend on the device under test
                model_dir = make_agreement_model(Path(tmp) / fmt, fmt)
            log(f"  device vs CPU: {fmt} checkpoint made, comparing")
            rows += check_device_agreement(model_dir, device=device)
    log(f"  device vs CPU: {worst_line(rows)}")
    return rows


def agreement_violations(rows: list[AgreementRow]) -> list[str]:
    return [f"device vs CPU: {r.checkpoint} checkpoint, prompt of {r.prompt}, {r.part}: relative difference {r.rel_diff:.3g} "
            f"(limit {DEVICE_AGREEMENT_MAX_REL_DIFF})" for r in rows if r.rel_diff > DEVICE_AGREEMENT_MAX_REL_DIFF]


def worst_line(rows: list[AgreementRow]) -> str:
    worst = max(rows, key=lambda r: r.rel_diff)
    return (f"worst relative difference {worst.rel_diff:.3g} ({worst.checkpoint} checkpoint, prompt of {worst.prompt}, "
            f"{worst.part}; limit {DEVICE_AGREEMENT_MAX_REL_DIFF})")


def format_agreement(rows: list[AgreementRow]) -> str:
    lines = ["| checkpoint | prompt | part | relative difference | ok |", "|---|---:|---|---:|---|"]
    lines += [f"| {r.checkpoint} | {r.prompt} | {r.part} | {r.rel_diff:.3g} | "
              f"{'yes' if r.rel_diff <= DEVICE_AGREEMENT_MAX_REL_DIFF else '**NO**'} |" for r in rows]
    return "\n".join(lines)


def check_agreement_command(allow_cpu: bool, as_json: bool, out: Path | None = None) -> int:
    """`tessera check agreement`: `check gpu`'s device-vs-CPU part alone (about a minute once MLX's kernels are
    compiled and cached; minutes on a fresh machine: docs/BENCHMARKS.md "Session 11"). 0 when every
    layer and logit row agrees; 1 on any violation; 2 without CUDA unless --allow-cpu (then the CPU is
    compared with itself: a pass there proves nothing about a device)."""
    import json
    import sys

    from tessera.kernels.cuda import on_cuda

    if not on_cuda() and not allow_cpu:
        print(f"error: no CUDA device ({mx.default_device()}); `check agreement` compares a CUDA device with the CPU "
              "(--allow-cpu compares the CPU with itself instead)", file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr)) if as_json else print  # noqa: E731
    rows = run_device_agreement(mx.default_device(), log)
    violations = agreement_violations(rows)
    report = {"device": str(mx.default_device()), "rows": [asdict(r) for r in rows], "violations": violations}
    print(json.dumps(report) if as_json else "\n".join(
        [format_agreement(rows), "", worst_line(rows), ""] + ([f"VIOLATION: {v}" for v in violations] or ["no violations"])))
    if out is not None:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if violations else 0


def check_device_agreement(model_dir: Path, device: mx.Device = mx.gpu, reference: mx.Device = mx.cpu,
                           lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[AgreementRow]:
    """Every layer and the logits of each prompt, `device` against `reference` (float32 activations)."""
    model = load_model(Path(model_dir), dtype="float32")
    rows = []
    for seed, length in enumerate(lengths):
        tokens = random_tokens(model.cfg.vocab_size, length, seed)
        rows += compare_prompt(model, tokens, partial(evaluated_on, device), partial(evaluated_on, reference))
    return rows


def compare_prompt(model: DeepseekV4, tokens: list[int], on_device, on_reference) -> list[AgreementRow]:
    """on_device / on_reference: (step, model, streams, segments) -> the step's output evaluated there. The prompt,
    then one decoded token (DECODE_TOKEN) on each side's cache: every layer and the logits of both steps."""
    checkpoint = "official" if any(isinstance(w, QuantizedWeight) for w in model.weights.values()) else "plain"
    caches = {"device": model.new_cache(), "reference": model.new_cache()}
    rows = _compare_step(model, caches, tokens, on_device, on_reference, checkpoint, len(tokens), "")
    return rows + _compare_step(model, caches, [DECODE_TOKEN], on_device, on_reference, checkpoint, len(tokens), "decode ")


def _compare_step(model: DeepseekV4, caches: dict, tokens: list[int], on_device, on_reference, checkpoint: str,
                  prompt: int, label: str) -> list[AgreementRow]:
    """`tokens` through every layer on both sides, each layer from the reference's streams; then both caches
    hold them (advance_caches), so the next step reads what each side appended."""
    segments = {side: [Segment(cache, tokens)] for side, cache in caches.items()}
    streams = on_reference(_embed, model, None, segments["reference"])
    rows = []
    for i in model.layer_ids:
        step = LayerStep(i)
        got = on_device(step, model, streams, segments["device"])
        streams = on_reference(step, model, streams, segments["reference"])
        rows.append(AgreementRow(checkpoint, prompt, f"{label}layer {i} ({model.cfg.layer_types[i]})", rel_diff(got, streams)))
    got = on_device(_head, model, streams, segments["device"])
    want = on_reference(_head, model, streams, segments["reference"])
    for side_segments in segments.values():
        advance_caches(side_segments)
    return rows + [AgreementRow(checkpoint, prompt, f"{label}logits", rel_diff(got, want))]


def rel_diff(got: mx.array, want: mx.array) -> float:
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    return float(np.abs(g - w).max() / max(float(np.abs(w).max()), 1e-30))


def evaluated_on(device: mx.Device, step: Step, model: DeepseekV4, streams: mx.array | None, segments: list[Segment]) -> mx.array:
    with mx.stream(device):
        out = step(model, streams, segments)
        mx.eval(out)
    return out


def _embed(model: DeepseekV4, streams: mx.array | None, segments: list[Segment]) -> mx.array:
    return model.embed(segments)


@dataclass(frozen=True)
class LayerStep:
    """Layer `layer` alone over the streams (its cache in the segments gets the prompt's rows)."""

    layer: int

    def __call__(self, model: DeepseekV4, streams: mx.array, segments: list[Segment]) -> mx.array:
        return model.run_layers(streams, segments, range(self.layer, self.layer + 1), tile=16)


def _head(model: DeepseekV4, streams: mx.array, segments: list[Segment]) -> mx.array:
    return model.logits(streams[-1:], segments, False)[0]  # the prompt's last token
