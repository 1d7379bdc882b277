"""Graph nodes (primitives, counted in `mx.export_to_dot`'s output) of one decode step at batch 1 and
batch 2 on a model dir: the shared part of a step (2·n1 − n2) and the part per sequence (n2 − n1).

python docs/bench/issue14_node_count.py MODEL_DIR [--ctx 300] [--compile on|off]   # one JSON line

Runs on any checkout of this repository (before and after Issue 14's decode-overhead work); prefill
chunk 128, tile 64. With --compile it sets engine/model/compiled.py's switch where that exists.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.bench_decode import DecodeOptions, _prefill
from tessera.engine.tools.replay import random_tokens


def primitives(arrays) -> collections.Counter:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *arrays)
        return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', path.read_text()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", type=Path)
    p.add_argument("--ctx", type=int, default=300)
    p.add_argument("--compile", choices=["on", "off"], default=None)
    args = p.parse_args()
    if args.compile is not None:
        from tessera.kernels.shapeless import set_compile_enabled

        set_compile_enabled(args.compile == "on")
    model = load_model(args.model_dir)
    caches = [_prefill(model, random_tokens(model.cfg.vocab_size, args.ctx, seed=b), DecodeOptions(128, 64)) for b in range(2)]
    counts = {}
    for batch in (1, 2):
        logits = model.forward([Segment(c, [1]) for c in caches[:batch]])
        counts[batch] = primitives(logits)
        mx.eval(logits, [c.arrays() for c in caches])
    n1, n2 = sum(counts[1].values()), sum(counts[2].values())
    print(json.dumps({"model": str(args.model_dir), "ctx": args.ctx, "compile": args.compile, "nodes_batch1": n1,
                      "nodes_batch2": n2, "shared": 2 * n1 - n2, "per_sequence": n2 - n1,
                      "batch1_by_primitive": dict(counts[1].most_common())}))


if __name__ == "__main__":
    main()
