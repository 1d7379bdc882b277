"""What the decode probes in docs/bench share: JSON lines written as they are measured, and the checkpoint
loaded as a user serves it or dequantized to bf16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlx.core as mx

from tessera.engine.model.deepseek_v4 import DeepseekV4
from tessera.engine.model.loader import load_model
from tessera.engine.model.quantized import QuantizedWeight


def jsonl_emitter(path: str | Path, echo_chars: int = 400) -> Callable[..., None]:
    """emit(kind, **row): one JSON line to `path` at once (a run cut short keeps what it measured), echoed."""
    out = open(path, "w")

    def emit(kind: str, **row) -> None:
        line = json.dumps({"what": kind, "device": str(mx.default_device()), **row})
        out.write(line + "\n")
        out.flush()
        print(line[:echo_chars], flush=True)

    return emit


def load_probe_model(model_dir: str | Path, as_loaded: bool) -> DeepseekV4:
    """The checkpoint as loaded (mxfp8 / mxfp4 weights of an official one), or dequantized to bf16."""
    model = load_model(Path(model_dir))
    if not as_loaded and any(isinstance(w, QuantizedWeight) for w in model.weights.values()):
        from tessera.engine.tools.quant_bench import _dequantized_model

        model = _dequantized_model(model, mx.bfloat16)
    return model
