"""The padded MoE layout of tests/test_kernels_cuda.py::test_padded_layout_gives_the_same_bits_with_and_without_its_kernels,
one arm per process (session 8: which half of that test, if any, ended its process on the H200 in session 7):
  python docs/bench/padded_layout_probe.py COMBINE INDEX SKEWED    (each 0 or 1)
COMBINE / INDEX switch the two kernels of kernels/moe_padded.py; SKEWED routes 4 of 32 experts 8x as often.
(Session 8 ran it with a fourth argument, since removed with the combine's shared-expert form.)"""
import sys, numpy as np, mlx.core as mx
from tessera.engine.model import moe as moe_mod
from tessera.kernels import moe_padded
comb, idx, skewed = (int(a) for a in sys.argv[1:4])
moe_padded.set_combine_kernel_enabled(bool(comb)); moe_padded.set_index_kernel_enabled(bool(idx))
rng = np.random.default_rng(3)
experts, dim, inter, tokens, k = 32, 256, 128, 512, 4
w = moe_mod.MoEWeights(
    router=mx.zeros((experts, dim)), correction_bias=None, tid2eid=None,
    w1=mx.array(rng.standard_normal((experts, inter, dim)).astype(np.float32) * 0.05).astype(mx.bfloat16),
    w2=mx.array(rng.standard_normal((experts, dim, inter)).astype(np.float32) * 0.05).astype(mx.bfloat16),
    w3=mx.array(rng.standard_normal((experts, inter, dim)).astype(np.float32) * 0.05).astype(mx.bfloat16),
    shared_w1=mx.zeros((inter, dim)), shared_w2=mx.zeros((dim, inter)), shared_w3=mx.zeros((inter, dim)))
x = mx.array(rng.standard_normal((tokens, dim)).astype(np.float32)).astype(mx.bfloat16)
p = np.where(np.arange(experts) < 4, 8.0, 1.0) if skewed else np.ones(experts)
chosen = np.stack([rng.choice(experts, k, replace=False, p=p / p.sum()) for _ in range(tokens)]).astype(np.int32)
weights = mx.array(rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32))
chosen = mx.array(chosen); flat = chosen.reshape(-1); order = mx.argsort(flat)
counts = moe_mod.expert_counts(flat, experts); cnp = np.array(counts)
plan = moe_mod.plan_padded(cnp, moe_mod.overflow_cost(w), moe_mod.PADDED_MAX_ROWS_PER_PAIR * flat.shape[0])
print("plan", plan, "rows", plan.rows(experts), "counts", cnp.tolist(), flush=True)
t, s = moe_mod.padded_indices(order, flat, counts, cnp, plan, k); mx.eval(t, s)
print("tokens range", int(t.min()), int(t.max()), "slot range", int(s.min()), int(s.max()), flush=True)
out = moe_mod.routed_experts(x, chosen, weights, w, 10.0, layout="padded"); mx.eval(out)
print("routed ok", float(mx.abs(out).max()), flush=True)
print("DONE", flush=True)
