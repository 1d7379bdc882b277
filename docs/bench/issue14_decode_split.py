"""Lead's first-lease probe (session 6): where a batch-1 decode step's time goes on the H200.
Per step: build ms (Python builds the graph), eval ms (until the sampled id is on the host); arms:
sync = today's code (whole graph built, then evaluated), async = each layer's streams handed to the
device with mx.async_eval as soon as its graph is built. Rounds A B B A A B B A; then bench_decode's own
harness in the same process, for the 6.6 vs 11.3 ms question.
python decode_split.py MODEL_DIR OUT.jsonl [--ctx 65536]"""
import json, statistics, sys, time
from pathlib import Path
import mlx.core as mx
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.tools.bench_decode import DecodeOptions, _filled, bench_decode

class AsyncLayers(ForwardTrace):
    def __init__(self, hc, d):
        super().__init__(stage_sync=False)
        self.hc, self.d = hc, d
    def stage(self, name, *arrays):
        a = arrays[0]
        if name == "other" and len(arrays) == 1 and a.ndim == 3 and a.shape[1] == self.hc and a.shape[2] == self.d:
            mx.async_eval(a)
        return a

def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 65536
    out = open(out_path, "w")
    def emit(**row):
        line = json.dumps(row); print(line, flush=True); out.write(line + "\n"); out.flush()
    t0 = time.perf_counter()
    model = load_model(Path(model_dir))
    cache = _filled(model, ctx, 0, DecodeOptions(4096, 1024, cache_fill="random"))
    mx.synchronize()
    emit(what="setup", seconds=time.perf_counter() - t0, ctx=ctx, device=str(mx.default_device()), mlx=mx.__version__)
    cfg = model.cfg
    ids = [1]
    def step(timer):
        nonlocal ids
        s = time.perf_counter()
        logits = model.forward([Segment(cache, ids)], timer=timer)
        b = time.perf_counter()
        ids = mx.argmax(mx.concatenate(logits), axis=-1).tolist()
        e = time.perf_counter()
        mx.eval(cache.arrays())
        return (b - s) * 1e3, (e - b) * 1e3
    arms = {"sync": lambda: ForwardTrace(stage_sync=False), "async": lambda: AsyncLayers(cfg.hc_mult, cfg.hidden_size)}
    for arm in ["sync", "async", "async", "sync", "sync", "async", "async", "sync"]:
        for _ in range(3):
            step(arms[arm]())
        rows = [step(arms[arm]()) for _ in range(24)]
        emit(what="round", arm=arm, build_ms=statistics.median(r[0] for r in rows), eval_ms=statistics.median(r[1] for r in rows),
             total_ms=statistics.median(r[0] + r[1] for r in rows), totals=[round(r[0] + r[1], 3) for r in rows])
    report = bench_decode(model, ctx, 1, DecodeOptions(4096, 1024, steps=24, cache_fill="random"))
    emit(what="bench_decode", **{k: v for k, v in report.items() if not isinstance(v, (list, dict))})
    emit(what="done", seconds=time.perf_counter() - t0)

main()
