"""Load a V4 checkpoint directory: `config.json` + safetensors (one file, or shards listed in
`model.safetensors.index.json`), official or transformers tensor names, fp32/bf16/fp16 weights.

Errors name what is wrong: the missing path, the unknown model_type, the missing or unexpected
tensor, the tensor whose shape does not match (with both shapes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import mlx.core as mx

from engine.model.config import ModelConfig, config_from_dict
from engine.model.dtypes import DTYPES
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.weights import canonical_name, expected_shapes, expert_key, layer_of



class CheckpointError(ValueError):
    """A model directory Tessera cannot load; the message says what and where."""


def load_config(model_dir: Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"missing file: {config_path}")
    return config_from_dict(json.loads(config_path.read_text()))


def load_model(model_dir: Path, dtype: str | None = None, progress: bool = True,
               layers: range | None = None, vocab: bool = True) -> DeepseekV4:
    """dtype: compute dtype ("float32" on CPU); None keeps the checkpoint's.

    A pipeline stage (engine/parallel/) loads only `layers` (None: all) and, with `vocab`, the model-wide
    tensors (embedding, head, final norms). The whole checkpoint is still checked for names; shapes
    only where loaded. `mx.load` maps tensors lazily, so what is left out is never read into memory."""
    cfg = load_config(model_dir)
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    if not (0 <= layers.start < layers.stop <= cfg.num_hidden_layers and layers.step == 1):
        raise ValueError(f"layer range {layers.start}..{layers.stop} is not a non-empty part of the model's "
                         f"{cfg.num_hidden_layers} layers")
    files = _weight_files(Path(model_dir))
    raw = _read_tensors(files, progress)
    weights = _check_and_stack(raw, cfg, lambda name: _wanted(name, layers, vocab))
    if dtype is not None:
        target = DTYPES[dtype]
        weights = {k: v if not mx.issubdtype(v.dtype, mx.floating) else v.astype(target) for k, v in weights.items()}
    mx.eval(list(weights.values()))
    return DeepseekV4(cfg, weights, layers)


def _wanted(name: str, layers: range, vocab: bool) -> bool:
    layer = layer_of(name)
    return vocab if layer is None else layer in layers


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"missing file: no *.safetensors (or model.safetensors.index.json) in {model_dir}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"missing file: {f} (listed in model.safetensors.index.json)")
    return files


def _read_tensors(files: list[Path], progress: bool) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    total = sum(f.stat().st_size for f in files)
    done = 0
    show = progress and total > 256 * 2**20  # a bar only where loading takes noticeable time
    for f in files:
        for name, tensor in mx.load(str(f)).items():
            out[canonical_name(name)] = tensor
        done += f.stat().st_size
        if show:
            _progress_bar(done, total)
    if show:
        print(file=sys.stderr)
    return out


def _progress_bar(done: int, total: int) -> None:
    width = 40
    filled = int(width * done / total)
    sys.stderr.write(f"\rloading weights [{'#' * filled}{'.' * (width - filled)}] {done / 2**30:.1f}/{total / 2**30:.1f} GiB")
    sys.stderr.flush()


def _check_and_stack(raw: dict[str, mx.array], cfg: ModelConfig, wanted: Callable[[str], bool]) -> dict[str, mx.array]:
    """Check names (all of them) and shapes, then keep the `wanted` tensors with experts stacked."""
    expected = expected_shapes(cfg)
    unexpected = sorted(set(raw) - set(expected) - _IGNORED(raw))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r}" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    missing = sorted(set(expected) - set(raw))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    expected = {name: shape for name, shape in expected.items() if wanted(name)}
    for name, shape in expected.items():
        if tuple(raw[name].shape) != shape:
            raise CheckpointError(f"shape mismatch for tensor {name!r}: checkpoint has {tuple(raw[name].shape)}, config expects {shape}")
    return _stack_experts({k: raw[k] for k in expected})


def _IGNORED(raw: dict[str, mx.array]) -> set[str]:
    """Tensors V4 checkpoints carry that inference does not use (the multi-token-prediction head)."""
    return {k for k in raw if k.startswith("mtp.")}


def _stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """`experts.E.w1.weight` × E -> `experts.w1` [E, ...], so a layer's experts are one array each."""
    groups: dict[str, dict[int, mx.array]] = {}
    out: dict[str, mx.array] = {}
    for name, tensor in weights.items():
        key = expert_key(name)
        if key is None:
            out[name] = tensor
        else:
            groups.setdefault(key[0], {})[key[1]] = tensor
    for stacked, by_index in groups.items():
        out[stacked] = mx.stack([by_index[e] for e in sorted(by_index)])
    return out
