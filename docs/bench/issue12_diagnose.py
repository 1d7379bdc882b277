"""Issue 12's diagnostic run on the H200 (docs/BENCHMARKS.md, "Issue 12"): reproduce the tile
dependence with the attention computed per tile as before, bisect by swapping the CUDA kernels for
their references, then run `check gpu` on the fixed code, and measure decode vs fresh prefill at
chunk 3001 before and after. Usage: python3 -u docs/bench/issue12_diagnose.py OUT_DIR"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from tessera.engine.model import attention
from tessera.engine.model.loader import load_model
from tessera.engine.tools import gpu_check
from tessera.engine.tools.consistency import check_model_consistency
from tessera.kernels import indexer_cuda, topk_cuda

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
T0 = time.perf_counter()


def emit(name: str, value) -> None:
    line = json.dumps({"step": name, "t": round(time.perf_counter() - T0, 1), "value": value}, default=str)
    print(line, flush=True)
    with open(OUT / "issue12-diagnose.jsonl", "a") as f:
        f.write(line + "\n")


@contextmanager
def per_tile_attention():
    """The code before the fix: one attention call per tile, shaped by the tile."""
    saved = attention.attention_blocks
    attention.attention_blocks = lambda r0, r1, length, block=0: [(r0, r1, r0, r1)]
    try:
        yield
    finally:
        attention.attention_blocks = saved


@contextmanager
def reference_kernels():
    saved = indexer_cuda.is_supported, topk_cuda.is_supported
    indexer_cuda.is_supported = lambda *a: False
    topk_cuda.is_supported = lambda *a: False
    try:
        yield
    finally:
        indexer_cuda.is_supported, topk_cuda.is_supported = saved


def matrix(model_dir, shapes, dtypes):
    rows = gpu_check.consistency_matrix(model_dir, shapes, dtypes, log=lambda *a: None)
    return [{"dtype": r.dtype, "ctx": r.ctx, "chunk": r.chunk, "tile": r.tile, "max_abs_diff": r.max_abs_diff,
             "differing_selections": r.differing_selections, "compared": r.compared_selections} for r in rows]


def main() -> None:
    emit("device", str(mx.default_device()))
    model_dir = gpu_check.make_check_model(Path("/tmp/issue12/flash-attn-3"))
    emit("model", str(model_dir))
    inv = gpu_check.check_row_invariance(index_heads=64, index_dim=128, topk=512, heads=64, head_dim=512, window=128)
    emit("row_invariance", inv)
    bisect = (gpu_check.Shape(5011, 3001, 701), gpu_check.Shape(5011, 3001, 1000))
    with per_tile_attention():
        emit("A per-tile attention + CUDA kernels", matrix(model_dir, bisect, ("bfloat16", "float32")))
        with reference_kernels():
            emit("B per-tile attention + reference kernels", matrix(model_dir, bisect, ("bfloat16",)))
    with reference_kernels():
        emit("C fixed-block attention + reference kernels", matrix(model_dir, bisect, ("bfloat16",)))
    emit("D fixed-block attention + CUDA kernels", matrix(model_dir, bisect, ("bfloat16", "float32")))
    rc = gpu_check.check_gpu_command(model_dir, None, None, False, False)
    emit("E check gpu (fixed code) exit status", rc)
    model = load_model(model_dir, dtype="bfloat16", progress=False)
    for chunk, tile in ((3001, 701), (3001, 3001), (3072, 701)):
        for name, ctx_manager in (("before", per_tile_attention), ("after", None)):
            if ctx_manager is None:
                report = check_model_consistency(model, 20011, 2, chunk, tile)
            else:
                with ctx_manager():
                    report = check_model_consistency(model, 20011, 2, chunk, tile)
            emit(f"F decode vs fresh, chunk {chunk} tile {tile}, {name}", report.as_dict())


if __name__ == "__main__":
    main()
