"""Where the device and the CPU part ways, function by function, each device in its own process.

`tessera check gpu`'s device-vs-CPU part (engine/tools/device_agreement.py) names the first layer whose
output differs; this names the first *function* inside it. Every module-level function of
tessera.engine.model.* and tessera.kernels.* is wrapped to record its array outputs (the n-th call of
each function is one record), the agreement model's prompt runs through the whole model, and `compare`
lines two recordings up by (function, call number). One process per device keeps the two runs from
sharing anything (compile caches, kernel caches, streams).

  python docs/bench/gpu_vs_cpu_stages.py model DIR                      # the agreement model (run on the CPU)
  python docs/bench/gpu_vs_cpu_stages.py record DIR OUT.npz --device gpu --length 1
  python docs/bench/gpu_vs_cpu_stages.py compare GPU.npz CPU.npz [--limit 1e-2]

Functions that run only on one device (a CUDA kernel against its reference) show as unmatched; their
callers still line up."""

from __future__ import annotations

import argparse
import sys
import types
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

_PACKAGES = ("tessera.engine.model", "tessera.kernels")
_SKIP = {"load_model", "on_cuda", "compile_enabled", "kernel_enabled", "step_compile_enabled"}


class Recorder:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.records: dict[str, np.ndarray] = {}
        self.order: list[str] = []
        self.depth = 0

    def wrap(self, name: str, fn):
        def recorded(*args, **kwargs):
            self.depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self.depth -= 1
            self.calls[name] += 1
            key = f"{self.depth:02d}|{name}#{self.calls[name]}"
            for j, a in enumerate(_arrays(out)):
                try:
                    self.records[f"{key}.{j}"] = np.array(a.astype(mx.float32))
                    self.order.append(f"{key}.{j}")
                except Exception:  # an array inside a compiled trace: not evaluable, not recorded
                    pass
            return out

        if hasattr(fn, "plain"):  # a ShapelessCompiled: compiled callers inline its plain form
            recorded.plain = fn.plain
        return recorded


def _arrays(out) -> list[mx.array]:
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (tuple, list)):
        return [a for o in out for a in _arrays(o)]
    return []


def install(recorder: Recorder) -> int:
    """Wraps every tessera function, in every module that binds it; returns how many."""
    from tessera.kernels.shapeless import ShapelessCompiled

    modules = [m for n, m in list(sys.modules.items()) if n.startswith(_PACKAGES) and m is not None]
    targets = {}
    for m in modules:
        for attr, obj in vars(m).items():
            own = obj.plain if isinstance(obj, ShapelessCompiled) else obj
            if isinstance(own, types.FunctionType) and own.__module__.startswith(_PACKAGES) and attr not in _SKIP:
                targets.setdefault(id(obj), (obj, f"{own.__module__.rsplit('.', 1)[-1]}.{own.__name__}"))
    wrapped = {i: recorder.wrap(name, obj) for i, (obj, name) in targets.items()}
    for m in modules:
        for attr, obj in list(vars(m).items()):
            if id(obj) in wrapped:
                setattr(m, attr, wrapped[id(obj)])
    return len(wrapped)


def record(model_dir: Path, out: Path, device: str, length: int) -> None:
    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.model.loader import load_model
    from tessera.engine.tools.replay import random_tokens

    mx.set_default_device(getattr(mx, device))
    model = load_model(model_dir, dtype="float32")
    recorder = Recorder()
    print("wrapped", install(recorder), "functions", flush=True)
    tokens = random_tokens(model.cfg.vocab_size, length, 0)
    logits = model.forward([Segment(model.new_cache(), tokens)], tile=16)[0]
    recorder.records["99|logits#1.0"] = np.array(logits)
    recorder.order.append("99|logits#1.0")
    np.savez(out, order=np.array(recorder.order), **{k.replace("/", "_"): v for k, v in recorder.records.items()})
    print("recorded", len(recorder.order), "arrays to", out, flush=True)


def compare(a_path: Path, b_path: Path, limit: float) -> None:
    a, b = np.load(a_path), np.load(b_path)
    shown = 0
    for key in [str(k) for k in a["order"]]:
        if key not in b.files:
            print(f"  only in {a_path.name}: {key}")
            continue
        x, y = a[key], b[key]
        if x.shape != y.shape:
            print(f"  shape {key}: {x.shape} vs {y.shape}")
            continue
        finite = np.abs(y[np.isfinite(y)])
        scale = max(float(finite.max()) if finite.size else 0.0, 1e-30)
        diff = np.where(x == y, 0.0, np.abs(x - y))  # equal infinities (masks) count as equal
        rel = float(np.nan_to_num(diff, nan=np.inf).max() / scale) if x.size else 0.0
        mark = "  <-- past the limit" if rel > limit else ""
        if mark or shown < 400:
            print(f"{rel:10.3e}  {key}  shape {x.shape}{mark}")
            shown += 1


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("dir", type=Path)
    r = sub.add_parser("record")
    r.add_argument("dir", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--device", choices=["gpu", "cpu"], required=True)
    r.add_argument("--length", type=int, default=1)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--limit", type=float, default=1e-2)
    args = p.parse_args()
    if args.cmd == "model":
        from tessera.engine.tools.device_agreement import make_agreement_model

        mx.set_default_device(mx.cpu)
        print(make_agreement_model(args.dir))
    elif args.cmd == "record":
        record(args.dir, args.out, args.device, args.length)
    else:
        compare(args.a, args.b, args.limit)


if __name__ == "__main__":
    main()
