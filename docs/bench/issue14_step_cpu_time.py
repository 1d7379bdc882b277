"""CPU time of decode steps at batch 1, 8, 16 (docs/BENCHMARKS.md "Issue 14, session 6"): process CPU
time per step (less sensitive than wall time to other processes on a shared machine), its graph-building
part, and wall time; small preset, ctx 2048, random caches, 12 steps after 2 warm-up steps. One JSON line.

python docs/bench/issue14_step_cpu_time.py MODEL_DIR
"""
import sys, statistics, json, time
from pathlib import Path
import mlx.core as mx
from tessera.engine.model.loader import load_model
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.tools.bench_decode import DecodeOptions, _filled
model = load_model(Path(sys.argv[1]))
opts = DecodeOptions(chunk=1024, tile=256, cache_fill="random")
caches = [_filled(model, 2048, b, opts) for b in range(16)]
out = {}
for B in (1, 8, 16):
    ids=[1]*B
    cpu, wall, build = [], [], []
    for step in range(14):
        c0, w0 = time.process_time(), time.perf_counter()
        logits = model.forward([Segment(c, [t]) for c, t in zip(caches[:B], ids)])
        b1 = time.process_time()
        ids = mx.argmax(mx.concatenate(logits), axis=-1).tolist()
        mx.eval([c.arrays() for c in caches[:B]])
        if step >= 2:
            cpu.append((time.process_time()-c0)*1000); wall.append((time.perf_counter()-w0)*1000); build.append((b1-c0)*1000)
    out[B] = {"cpu_ms_median": round(statistics.median(cpu),2), "build_cpu_ms_median": round(statistics.median(build),2), "wall_ms_median": round(statistics.median(wall),2)}
print(json.dumps(out))
