"""Load a V4 checkpoint directory: `config.json` + safetensors (one file, or shards listed in
`model.safetensors.index.json`), official or transformers tensor names, in any of three forms:

- plain: every projection fp32/bf16/fp16;
- official (DeepSeek's release): FP8 E4M3 128×128-block dense weights and FP4 experts with E8M0
  `.scale` tensors (engine/model/official_format.py) -> MLX `mxfp8` / `mxfp4` arrays, no float copy;
- MLX-native (written by `tessera convert`): uint32 values + `.scales` (+ `.biases` for affine).

A *random-weights directory* (`random_weights.json` instead of weight files; `make-model --in-memory`)
loads as an official checkpoint of its config would, with the arrays made on the device for the layers
asked for (engine/model/random_weights.py): how V4 Flash's ~149 GiB run without a file.

Shards are memory-mapped and parsed from their raw bytes (engine/model/safetensors_file.py), since
numpy has no FP8/E8M0 dtypes. Errors name what is wrong: the missing path, the unknown model_type,
the missing or unexpected tensor, the tensor whose shape or dtype does not fit (with its shape),
the truncated shard.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from tessera.engine.model.config import ModelConfig, config_from_dict
from tessera.engine.model.deepseek_v4 import DeepseekV4
from tessera.engine.model.dtypes import DTYPES
from tessera.engine.model.official_format import (
    dequantize_fp4, dequantize_fp8, fp4_scale_shape, fp8_scale_shape, mxfp4_from_packed, mxfp8_from_blocks,
)
from tessera.engine.model.quantized import QuantizedWeight, Weight, weight_arrays
from tessera.engine.model.random_weights import RANDOM_WEIGHTS_FILE, RandomWeightsSpec, random_official_weights, read_spec
from tessera.engine.model.safetensors_file import RawTensor, SafetensorsError, open_tensors
from tessera.engine.model.weights import canonical_name, expected_shapes, expert_key, layer_of, stacked_expert_names

PROGRESS_MIN_BYTES = 256 * 2**20  # a progress bar only where loading takes noticeable time
_FLOAT_TAGS = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
_INT_TAGS = ("I64", "I32")


class CheckpointError(ValueError):
    """A model directory Tessera cannot load; the message says what and where."""


@dataclass(frozen=True)
class LoadOptions:
    dtype: str | None = None  # compute dtype of float tensors; None keeps the checkpoint's
    weights_dtype: str | None = None  # dequantize quantized weights to this dtype at load (debugging)
    progress: bool = True


def load_config(model_dir: Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"missing file: {config_path}")
    return config_from_dict(json.loads(config_path.read_text()))


def load_model(model_dir: Path, dtype: str | None = None, progress: bool = True, weights_dtype: str | None = None,
               layers: range | None = None, vocab: bool = True) -> DeepseekV4:
    """dtype: compute dtype ("float32" on CPU); None keeps the checkpoint's. weights_dtype: dequantize
    FP8/FP4/affine weights to this float dtype at load instead of computing on them quantized.

    A pipeline stage (engine/parallel/) loads only `layers` (None: all) and, with `vocab`, the model-wide
    tensors (embedding, head, final norms). Every name is still checked; shapes only where loaded. The
    shards are memory-mapped, so what is left out is never read into memory."""
    cfg = load_config(model_dir)
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    if not (0 <= layers.start < layers.stop <= cfg.num_hidden_layers and layers.step == 1):
        raise ValueError(f"layer range {layers.start}..{layers.stop} is not a non-empty part of the model's "
                         f"{cfg.num_hidden_layers} layers")
    wanted = lambda name: _wanted(name, layers, vocab)  # noqa: E731
    opts = LoadOptions(dtype, weights_dtype, progress)
    spec = read_spec(Path(model_dir))
    if spec is not None:  # a random-weights directory: the arrays are made on the device, no file is read
        weights = dict(_random_weights(Path(model_dir), cfg, spec, opts, wanted))
    else:
        weights = dict(_converted(_open_all(_weight_files(Path(model_dir))), cfg, opts, wanted))
    mx.eval([a for w in weights.values() for a in weight_arrays(w)])
    return DeepseekV4(cfg, weights, layers)


def _random_weights(model_dir: Path, cfg: ModelConfig, spec: RandomWeightsSpec, opts: LoadOptions,
                    wanted: Callable[[str], bool]) -> Iterator[tuple[str, Weight]]:
    """engine/model/random_weights.py's arrays, finished as a checkpoint's are (compute dtype, --weights-dtype)."""
    stray = sorted(model_dir.glob("*.safetensors"))
    if stray:
        raise CheckpointError(f"{model_dir} has both {RANDOM_WEIGHTS_FILE} and weight files ({stray[0].name}): "
                              f"remove one, a directory is either a checkpoint or a random-weights model")
    total = sum(prod(shape) for name, shape in expected_shapes(cfg).items() if wanted(name))
    done = 0
    for i, (name, w) in enumerate(random_official_weights(cfg, spec.seed, wanted)):
        if opts.weights_dtype and isinstance(w, QuantizedWeight):
            w = w.dequantize(DTYPES[opts.weights_dtype])
        done += prod(w.shape)
        if opts.progress and total > PROGRESS_MIN_BYTES and (i % 16 == 0 or done == total):
            _progress_bar(done, total, "random weights", "G values")
        yield name, _finish(w, opts)
    if opts.progress and total > PROGRESS_MIN_BYTES:
        print(file=sys.stderr)


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


def _open_all(files: list[Path]) -> dict[str, RawTensor]:
    out: dict[str, RawTensor] = {}
    for f in files:
        try:
            tensors = open_tensors(f)
        except SafetensorsError as exc:
            raise CheckpointError(str(exc)) from exc
        for name, tensor in tensors.items():
            out[canonical_name(name)] = tensor
    return out


# ---- names and shapes -------------------------------------------------------------------------


def _companions(raw: dict[str, RawTensor]) -> set[str]:
    """`.scale` (official) and `.scales` / `.biases` (MLX-native) tensors belong to a weight."""
    return {k for k in raw if k.endswith((".scale", ".scales", ".biases")) and _owner(k) in raw}


def _owner(companion: str) -> str:
    base = companion.rsplit(".", 1)[0]
    return base + ".weight" if companion.endswith(".scale") else base


def _check_names(raw: dict[str, RawTensor], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """-> the tensors to build, name -> logical shape; stacked MLX-native experts replace per-expert names."""
    expected = expected_shapes(cfg)
    for stacked, members in stacked_expert_names(cfg).items():
        if stacked in raw:
            first = expected[members[0]]
            for m in members:
                del expected[m]
            expected[stacked] = (len(members), *first)
    ignored = {k for k in raw if k.startswith("mtp.")} | _companions(raw)
    missing = sorted(set(expected) - set(raw))  # first: a missing weight leaves its scale looking unexpected
    if missing:
        raise CheckpointError(_first(f"missing tensor {missing[0]!r} (config expects {expected[missing[0]]})", missing))
    unexpected = sorted(set(raw) - set(expected) - ignored)
    if unexpected:
        raise CheckpointError(_first(f"unexpected tensor {unexpected[0]!r} {raw[unexpected[0]].shape}", unexpected))
    return expected


def _first(message: str, names: list[str]) -> str:
    return message + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def _mismatch(name: str, got: tuple[int, ...], want: tuple[int, ...], what: str = "") -> CheckpointError:
    return CheckpointError(f"shape mismatch for tensor {name!r}{what}: checkpoint has {tuple(got)}, config expects {tuple(want)}")


# ---- one tensor -------------------------------------------------------------------------------


def iter_weights(model_dir: Path, dtype: str | None = None, progress: bool = True,
                 weights_dtype: str | None = None) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's weights one at a time, as load_model holds them (a layer's experts stacked into
    one `layers.N.ffn.experts.wK`), after every name and shape was checked — so a tool such as
    `tessera convert` can stream a model larger than memory."""
    cfg = load_config(model_dir)
    raw = _open_all(_weight_files(Path(model_dir)))
    yield from _converted(raw, cfg, LoadOptions(dtype, weights_dtype, progress))


def _converted(raw: dict[str, RawTensor], cfg: ModelConfig, opts: LoadOptions,
               wanted: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, Weight]]:
    expected = {name: shape for name, shape in _check_names(raw, cfg).items() if wanted(name)}
    total = sum(raw[n].data.nbytes for n in expected)
    show = opts.progress and total > PROGRESS_MIN_BYTES
    experts: dict[str, dict[int, Weight]] = {}
    done = 0
    for i, (name, shape) in enumerate(expected.items()):
        w = _finish(_tensor(raw, name, shape, opts.weights_dtype), opts)
        done += raw[name].data.nbytes
        if show and (i % 64 == 0 or done == total):
            mx.eval(weight_arrays(w))  # bounds the host copies in flight
            _progress_bar(done, total)
        key = expert_key(name)
        if key is None:
            yield name, w
            continue
        # stack a layer's experts as soon as all are read: peak memory stays ~ one layer over
        group = experts.setdefault(key[0], {})
        group[key[1]] = w
        if len(group) == cfg.n_routed_experts:
            stacked = _stack([group[e] for e in sorted(group)])
            mx.eval(weight_arrays(stacked))
            del experts[key[0]]
            yield key[0], stacked
    if show:
        print(file=sys.stderr)


def _finish(w: Weight, opts: LoadOptions) -> Weight:
    if opts.dtype is None:
        return w
    target = DTYPES[opts.dtype]
    if isinstance(w, QuantizedWeight):
        return w.with_float_dtype(target)
    return w.astype(target) if mx.issubdtype(w.dtype, mx.floating) else w


def _tensor(raw: dict[str, RawTensor], name: str, shape: tuple[int, ...], weights_dtype: str | None) -> Weight:
    t = raw[name]
    if t.dtype in _FLOAT_TAGS or t.dtype in _INT_TAGS:
        if t.shape != shape:
            raise _mismatch(name, t.shape, shape)
        if t.dtype == "BF16":
            return mx.array(np.ascontiguousarray(t.data)).view(mx.bfloat16)
        return mx.array(np.ascontiguousarray(t.data))
    if t.dtype == "F8_E4M3":
        return _fp8(raw, name, shape, weights_dtype)
    if t.dtype == "I8":
        return _fp4(raw, name, shape, weights_dtype)
    if t.dtype == "U32":
        return _mlx_native(raw, name, shape, weights_dtype)
    raise CheckpointError(f"tensor {name!r} {t.shape} has dtype {t.dtype}, which is not a weight format "
                          "(float, F8_E4M3 + .scale, packed FP4 I8 + .scale, or U32 + .scales)")


def _scale(raw: dict[str, RawTensor], name: str, suffix: str, want_shape: tuple[int, ...], tags: tuple[str, ...]) -> RawTensor:
    t = raw[name]
    scale_name = name.rsplit(".", 1)[0] + suffix if suffix == ".scale" else name + suffix
    if scale_name not in raw:
        raise CheckpointError(f"missing scale {scale_name!r} for tensor {name!r} {t.dtype} {t.shape}")
    s = raw[scale_name]
    if s.dtype not in tags:
        raise CheckpointError(f"tensor {scale_name!r} {s.shape} has dtype {s.dtype}, expected {' or '.join(tags)}")
    if s.shape != tuple(want_shape):
        raise _mismatch(scale_name, s.shape, want_shape, f" (scale of {name!r} {t.shape})")
    return s


def _fp8(raw: dict[str, RawTensor], name: str, shape: tuple[int, ...], weights_dtype: str | None) -> Weight:
    t = raw[name]
    if t.shape != shape:
        raise _mismatch(name, t.shape, shape, " (F8_E4M3)")
    scale = _scale(raw, name, ".scale", fp8_scale_shape(shape), ("F8_E8M0",)).data
    quantized = None if weights_dtype else mxfp8_from_blocks(t.data, scale)
    if quantized is not None:
        return quantized
    return mx.array(dequantize_fp8(t.data, scale)).astype(DTYPES[weights_dtype or "float32"])


def _fp4(raw: dict[str, RawTensor], name: str, shape: tuple[int, ...], weights_dtype: str | None) -> Weight:
    t = raw[name]
    packed_shape = (*shape[:-1], shape[-1] // 2)
    if t.shape != packed_shape:
        raise _mismatch(name, t.shape, packed_shape, f" (packed FP4, two values per byte of logical {shape})")
    scale = _scale(raw, name, ".scale", fp4_scale_shape(shape), ("F8_E8M0",)).data
    quantized = None if weights_dtype else mxfp4_from_packed(t.data, scale)
    if quantized is not None:
        return quantized
    return mx.array(dequantize_fp4(t.data, scale)).astype(DTYPES[weights_dtype or "float32"])


def _mlx_native(raw: dict[str, RawTensor], name: str, shape: tuple[int, ...], weights_dtype: str | None) -> Weight:
    """uint32 values + `.scales` (uint8: mxfp4/mxfp8; float + `.biases`: affine); bits and group from shapes."""
    t = raw[name]
    if t.shape[:-1] != shape[:-1] or (32 * shape[-1]) % t.shape[-1]:
        raise _mismatch(name, t.shape, shape, " (U32 packed values)")
    bits = 32 * t.shape[-1] // shape[-1]
    scales_name = name + ".scales"
    if scales_name not in raw:
        raise CheckpointError(f"missing scale {scales_name!r} for tensor {name!r} U32 {t.shape}")
    s = raw[scales_name]
    if s.shape[:-1] != shape[:-1] or s.shape[-1] == 0 or shape[-1] % s.shape[-1]:
        raise _mismatch(scales_name, s.shape, (*shape[:-1], "in/group"), f" (scales of {name!r})")
    group = shape[-1] // s.shape[-1]
    if s.dtype == "U8":
        mode, biases = ("mxfp4" if bits == 4 else "mxfp8"), None
    elif s.dtype in _FLOAT_TAGS:
        mode, biases = "affine", _scale(raw, name, ".biases", s.shape, (s.dtype,))
    else:
        raise CheckpointError(f"tensor {scales_name!r} {s.shape} has dtype {s.dtype}, expected U8 (mx formats) or a float (affine)")
    w = QuantizedWeight(mx.array(np.ascontiguousarray(t.data)), _as_mx(s), None if biases is None else _as_mx(biases), mode, bits, group)
    return w.dequantize(DTYPES[weights_dtype]) if weights_dtype else w


def _as_mx(t: RawTensor) -> mx.array:
    a = mx.array(np.ascontiguousarray(t.data))
    return a.view(mx.bfloat16) if t.dtype == "BF16" else a


def _progress_bar(done: int, total: int, what: str = "loading weights", unit: str = "GiB") -> None:
    width = 40
    filled = int(width * done / total)
    sys.stderr.write(f"\r{what} [{'#' * filled}{'.' * (width - filled)}] {done / 2**30:.1f}/{total / 2**30:.1f} {unit}")
    sys.stderr.flush()


def _stack(parts: list[Weight]) -> Weight:
    first = parts[0]
    if not isinstance(first, QuantizedWeight):
        return mx.stack(parts)
    biases = None if first.biases is None else mx.stack([p.biases for p in parts])
    return QuantizedWeight(mx.stack([p.values for p in parts]), mx.stack([p.scales for p in parts]), biases,
                           first.mode, first.bits, first.group_size)
