"""Issue 12 probe: MLX peak memory of one tile of `blockwise_attention` as the tile grows (how many
128-row blocks MLX keeps live at once). Output and command: docs/bench/issue12-attention-blocks-probe.txt."""
import sys, mlx.core as mx
from tessera.engine.model.attention import blockwise_attention, AttentionGroup
H, hd, R, W = 8, 128, 4000, 128
def run(t):
    mx.random.seed(0)
    q = mx.random.normal((t, H, hd)); comp = mx.random.normal((R, hd)); win = mx.random.normal((t, W, hd))
    vis = mx.arange(t) + 3000
    groups = [AttentionGroup(win, mx.ones((t, W), dtype=mx.bool_)),
              AttentionGroup(comp, mx.arange(R)[None, :] < vis[:, None], shared=True)]
    sinks = mx.zeros((H,))
    mx.eval(q, comp, win, vis, groups[1].valid, groups[0].valid, sinks)
    mx.synchronize(); mx.clear_cache(); base = mx.get_active_memory(); mx.reset_peak_memory()
    out = blockwise_attention(q, groups, sinks, 0.1, 0, t, t)
    mx.eval(out)
    peak = mx.get_peak_memory() - base
    logits_block = 128 * H * (R + W + 1) * 4
    print(t, "peak MiB", round(peak / 2**20, 1), "peak / one block's logits", round(peak / logits_block, 2), "out MiB", round(out.nbytes/2**20,1))
for t in map(int, sys.argv[1:]):
    run(t)
