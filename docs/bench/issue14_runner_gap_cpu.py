"""Issue 14, session 6: is the serving path's decode step slower than the bare forward pass? One process,
the same cache, four arms interleaved (order A B C D D C B A A B C D, 10 timed steps each after 2 warm-ups):
bare = model.forward + argmax; bare_tile = the same with the runner's tile and trace; bare_sample = the
runner's sampler instead of argmax; runner = ModelRunner.execute of a decode-only StepPlan.

python docs/bench/issue14_runner_gap_cpu.py MODEL_DIR [CTX [ROUNDS]]   # CPU: a small-preset checkpoint, ctx 2048
python docs/bench/issue14_runner_gap_cpu.py /dev/shm/fw 65536 4        # H200: flash-width, the decode benchmarks' ctx
Each round's medians are printed as it ends (a run cut short by a time limit still reports).
"""
import time, statistics, sys
import mlx.core as mx
from pathlib import Path
from tessera.engine.model.loader import load_model
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.tools.bench_decode import DecodeOptions, _filled
from tessera.engine.serving.runner import ModelRunner
from tessera.engine.serving.protocol import DecodeSlot, SamplingParams, StepPlan
from tessera.engine.serving.sampler import sample, TokenHistory, RequestRng
m = load_model(Path(sys.argv[1]))
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
cache = _filled(m, ctx, 0, DecodeOptions(1024, 256, cache_fill="random"))
# the serial step these runs measured (plans read positions off the cache)
runner = ModelRunner(m, prefill_chunk=1024, indexer_tile=256, max_context=ctx + 4096, decode_overlap=False)
runner.add_request("r", [1], SamplingParams(temperature=0.0, max_tokens=10**9))
runner._sequences["r"].cache = cache
nid = [1]
def bare():
    lg = m.forward([Segment(cache, nid[:])]); nid[0] = int(mx.argmax(lg[0], axis=-1).item())
def bare_tile():
    lg = m.forward([Segment(cache, nid[:])], tile=256, timer=ForwardTrace(stage_sync=False)); nid[0] = int(mx.argmax(lg[0], axis=-1).item())
seq = runner._sequences["r"]
def bare_sample():
    lg = m.forward([Segment(cache, nid[:])], tile=256, timer=ForwardTrace(stage_sync=False))
    s = sample(lg[0], [seq.sampling], [seq.history], [seq.rng]); nid[0] = s[0].token_id
def run():
    out = runner.execute(StepPlan(decodes=(DecodeSlot("r", nid[0], cache.num_tokens),))); nid[0] = out.sampled[0].token_id
arms = {"bare": bare, "bare_tile": bare_tile, "bare_sample": bare_sample, "runner": run}
res = {k: [] for k in arms}
for rnd in range(rounds):
    for name in (list(arms) if rnd % 2 == 0 else list(arms)[::-1]):
        times = []
        for i in range(12):
            t = time.perf_counter(); arms[name](); dt = (time.perf_counter() - t) * 1e3
            if i >= 2: times.append(dt)
        res[name].extend(times)
        print(f"round {rnd} {name} median {statistics.median(times):.2f} ms", flush=True)
for k, v in res.items(): print(k, round(statistics.median(v), 2), flush=True)
