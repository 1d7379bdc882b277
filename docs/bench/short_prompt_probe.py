"""Where a prefill dies on the GPU: prints every layer and every stage boundary (shapes) before it is
evaluated, so the last line before a crash or a hang names the layer and the stage. Used in session 8 for
the `tiny` model's 5-token prefill that segfaulted on the H200 (docs/BENCHMARKS.md, "Session 8 on the H200").
One arm per process:
  python docs/bench/short_prompt_probe.py MODEL_DIR 5,62,127,31 [nocompile,nosinkhorn,nogather,noidx,notopk,sync]
(the flags switch compilation or a CUDA kernel off; `sync` evaluates at every stage)."""
import sys, mlx.core as mx
from tessera.engine.model.loader import load_model
from tessera.engine.model.deepseek_v4 import Segment, DeepseekV4
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.tools.replay import random_tokens
from tessera.kernels import shapeless, sinkhorn, row_gather, indexer_cuda, topk_cuda
model_dir, lengths, flags = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], set(sys.argv[3].split(",")) if len(sys.argv) > 3 else set()
if "nocompile" in flags: shapeless.set_compile_enabled(False)
if "nosinkhorn" in flags: sinkhorn.set_kernel_enabled(False)
if "nogather" in flags: row_gather.set_kernel_enabled(False)
if "noidx" in flags: indexer_cuda.is_supported = lambda *a: False
if "notopk" in flags: topk_cuda.is_supported = lambda *a: False
print("flags", sorted(flags), "sinkhorn", sinkhorn.kernel_enabled(), "gather", row_gather.kernel_enabled(), flush=True)
orig_stage, orig_boundary = ForwardTrace.stage, ForwardTrace.boundary
def stage(self, name, *arrays):
    print("  stage", name, [a.shape for a in arrays][:3], flush=True); return orig_stage(self, name, *arrays)
def boundary(self, name, *arrays):
    print("  boundary", name, [a.shape for a in arrays][:3], flush=True); return orig_boundary(self, name, *arrays)
ForwardTrace.stage, ForwardTrace.boundary = stage, boundary
orig_layer = DeepseekV4._layer
def layer(self, streams, token_ids, rope, slices, lw, i, tile, timer):
    print(" layer", i, self.cfg.layer_types[i], flush=True); return orig_layer(self, streams, token_ids, rope, slices, lw, i, tile, timer)
DeepseekV4._layer = layer
model = load_model(model_dir, dtype="float32")
for seed, n in enumerate(lengths):
    cache = model.new_cache()
    print("prefill", n, flush=True)
    out = model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, n, seed))], tile=16,
                        timer=ForwardTrace(stage_sync="sync" in flags))
    mx.eval(out); print("ok", n, flush=True)
print("DONE", flush=True)
