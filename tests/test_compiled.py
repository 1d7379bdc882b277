"""The compiled hyper-connection math (engine/model/hyper.py, compiled shapeless by
kernels/shapeless.py) against the plain per-op formulation it replaced: identical bits, compiled
and not, float32 and bfloat16, for batches of different sizes run one after another (a shapeless trace
replayed on a new shape must not keep the old one), and the TESSERA_COMPILE switch."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import hyper
from tessera.kernels import shapeless as compiled
from tests.support.env_switch import switch_in_fresh_process
from tests.support.graph_nodes import primitive_kinds
from tests.support.rope_tables import padded_rope_tables

HC, WIDTH, ITERS, EPS = 4, 48, 20, 1e-6
NORM_EPS = 1e-2  # the norms' eps where a test tells it from the mixes' (EPS)


# ---- the reference: the per-op formulation (one op per Sinkhorn sum, division and epsilon) --------


def _rms(x, eps):
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def reference_hyper_weights(streams, w: hyper.HyperWeights, iters, hc_eps, norm_eps):
    """-> post [T, hc, 1] (the shape hyper_weights hands to expand), comb, collapsed."""
    t, hc, _ = streams.shape
    mixes = _rms(streams.reshape(t, -1).astype(mx.float32), norm_eps) @ w.fn.astype(mx.float32).T
    base, scale = w.base.astype(mx.float32), w.scale.astype(mx.float32)
    pre = mx.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * mx.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mixes[:, 2 * hc :].reshape(t, hc, hc) * scale[2] + base[2 * hc :].reshape(hc, hc)
    comb = mx.softmax(comb, axis=-1, precise=True) + hc_eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + hc_eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + hc_eps)
    return post[..., None], comb, (pre[..., None] * streams).sum(axis=1).astype(streams.dtype)


def as_mix_t(comb, dtype):
    """The reference's comb as hyper_weights hands it to expand: in the streams' dtype, transposed."""
    return comb.astype(dtype).transpose(0, 2, 1)


def reference_expand(block_out, streams, post, comb):
    mixed = comb.astype(streams.dtype).transpose(0, 2, 1) @ streams
    return post.astype(streams.dtype) * block_out[:, None, :] + mixed  # post: [T, hc, 1]


def reference_head_collapse(streams, fn, base, scale, hc_eps, norm_eps):
    mixes = _rms(streams.reshape(streams.shape[0], -1).astype(mx.float32), norm_eps) @ fn.astype(mx.float32).T
    pre = mx.sigmoid(mixes * scale.astype(mx.float32) + base.astype(mx.float32)) + hc_eps
    return (pre[..., None] * streams).sum(axis=1).astype(streams.dtype)


# ---- tests ------------------------------------------------------------------------------------------


def _weights(dtype, seed):
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    mixes = (2 + HC) * HC
    return hyper.HyperWeights(
        (mx.random.normal((mixes, HC * WIDTH), key=k1) * 0.2).astype(dtype),
        mx.random.normal((mixes,), key=k2).astype(dtype),
        mx.random.normal((3,), key=k3).astype(dtype),
    )


@pytest.fixture(autouse=True)
def _restore_switch():
    before = compiled.compile_enabled()
    yield
    compiled.set_compile_enabled(before)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "plain"])
def test_hyper_connections_give_the_reference_bits_for_every_batch_size(dtype, enabled):
    compiled.set_compile_enabled(enabled)
    w = _weights(dtype, 0)
    for step, rows in enumerate([1, 5, 64, 2, 1]):  # shapes change between calls of one trace
        streams = mx.random.normal((rows, HC, WIDTH), key=mx.random.key(10 + step)).astype(dtype)
        block_out = mx.random.normal((rows, WIDTH), key=mx.random.key(20 + step)).astype(dtype)
        got = hyper.hyper_weights(streams, w, ITERS, EPS, EPS)
        post, comb, collapsed = reference_hyper_weights(streams, w, ITERS, EPS, EPS)
        for name, a, b in zip(("post", "mix_t", "collapsed"), got, (post, as_mix_t(comb, dtype), collapsed)):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert mx.array_equal(a, b).item(), f"{name} differs at {rows} rows"
        assert mx.array_equal(hyper.expand(block_out, streams, got[0], got[1]), reference_expand(block_out, streams, post, comb)).item()
        head = (w.fn[:HC], w.base[:HC], w.scale[:1])
        got_head = hyper.head_collapse(streams, hyper.HyperWeights(*head), EPS, EPS)
        assert got_head.shape == (rows, WIDTH)
        assert mx.array_equal(got_head, reference_head_collapse(streams, *head, EPS, EPS)).item()


def test_sinkhorn_output_is_doubly_stochastic():
    streams = mx.random.normal((7, HC, WIDTH), key=mx.random.key(3))
    _, mix_t, _ = hyper.hyper_weights(streams, _weights(mx.float32, 1), ITERS, EPS, EPS)
    assert mx.allclose(mix_t.sum(axis=-1), mx.ones((7, HC)), atol=1e-3).item()
    assert mx.allclose(mix_t.sum(axis=-2), mx.ones((7, HC)), atol=1e-3).item()


def test_the_switch_really_changes_the_graph(tmp_path):
    """Compiled: the Sinkhorn's epsilon add and division are one fused primitive per half-step."""
    streams = mx.random.normal((3, HC, WIDTH), key=mx.random.key(4))
    w = _weights(mx.float32, 2)
    counts = {}
    for enabled in (True, False):
        compiled.set_compile_enabled(enabled)
        counts[enabled] = _node_count(hyper.hyper_weights(streams, w, ITERS, EPS, EPS), tmp_path / "step.dot")
    assert counts[True] < counts[False] * 0.6, counts


def _node_count(arrays, path) -> int:
    return sum(primitive_kinds(arrays, path).values())


@pytest.mark.parametrize("value,expected", [("0", "False"), ("1", "True"), (None, "True")])
def test_environment_switch(value, expected):
    assert switch_in_fresh_process(compiled.ENV_VAR, value, "tessera.kernels.shapeless", "compile_enabled") == expected


def test_environment_switch_rejects_other_values():
    env = {**os.environ, compiled.ENV_VAR: "off"}
    out = subprocess.run([sys.executable, "-c", "import tessera.kernels.shapeless"], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "TESSERA_COMPILE must be 0 (off) or 1 (on)" in out.stderr


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hash"])
def test_moe_gives_the_same_bits_compiled_and_plain(dtype, hashed):
    from tessera.engine.model.moe import MoEWeights, moe

    experts, dim, inner, vocab, top_k = 6, 32, 24, 50, 2
    keys = iter(mx.random.split(mx.random.key(7), 10))
    normal = lambda shape: (mx.random.normal(shape, key=next(keys)) * 0.3).astype(dtype)  # noqa: E731
    w = MoEWeights(
        router=normal((experts, dim)),
        correction_bias=None if hashed else normal((experts,)),
        tid2eid=mx.random.randint(0, experts, (vocab, top_k), key=next(keys)) if hashed else None,
        w1=normal((experts, inner, dim)), w2=normal((experts, dim, inner)), w3=normal((experts, inner, dim)),
        shared_w1=normal((inner, dim)), shared_w2=normal((dim, inner)), shared_w3=normal((inner, dim)),
    )
    for rows in (1, 7, 3):
        x = mx.random.normal((rows, dim), key=mx.random.key(rows)).astype(dtype) * 4  # large enough to hit the clamps
        ids = mx.arange(rows) % vocab
        outs = []
        for enabled in (True, False):
            compiled.set_compile_enabled(enabled)
            outs.append(moe(x, ids, w, top_k, 1.5, 0.7))
        assert outs[0].shape == (rows, dim) and outs[0].dtype == dtype
        assert mx.array_equal(outs[0], outs[1]).item(), f"{rows} rows"


def _reference_rope(x, cos, sin):
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    nope, rope = x[..., : -2 * half], x[..., -2 * half :]
    pairs = rope.reshape(*rope.shape[:-1], half, 2).astype(mx.float32)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rope.shape).astype(x.dtype)
    return mx.concatenate([nope, rotated], axis=-1)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "plain"])
def test_rope_gives_the_reference_bits_for_every_shape(dtype, enabled):
    from tessera.engine.model.rope import apply_rope

    compiled.set_compile_enabled(enabled)
    for step, shape in enumerate([(1, 8, 48), (5, 8, 48), (3, 48), (9, 2, 48), (1, 48)]):
        x = mx.random.normal(shape, key=mx.random.key(step)).astype(dtype)
        cos, sin = (mx.random.normal((shape[0], 16), key=mx.random.key(100 + step + k)) for k in range(2))
        tables = padded_rope_tables(cos, sin, shape[-1])
        got = apply_rope(x, tables)
        assert got.shape == x.shape and got.dtype == dtype
        assert mx.array_equal(got, _reference_rope(x, cos, sin)).item(), shape
        assert mx.array_equal(apply_rope(got, tables.inverse())[..., :16], x[..., :16]).item()  # the nope channels pass through
        rope_only = x[..., 16:]  # every channel rotates (the indexer's keys)
        assert mx.array_equal(apply_rope(rope_only, padded_rope_tables(cos, sin, 32)), _reference_rope(rope_only, cos, sin)).item()


def test_rope_passes_the_unrotated_channels_through_bit_for_bit():
    """-0, infinities and NaN in the channels that do not rotate come out as they went in (a product with
    cos 1 / sin 0 would not keep them)."""
    from tessera.engine.model.rope import apply_rope

    x = mx.array([[-0.0, mx.inf, -mx.inf, mx.nan, 1.0, 2.0, 3.0, 4.0]], dtype=mx.bfloat16)
    cos, sin = mx.array([[0.5, 0.25]]), mx.array([[0.75, -0.5]])
    got = apply_rope(x, padded_rope_tables(cos, sin, 8))
    want_bits = np.array(x[..., :4].view(mx.uint16))
    assert np.array_equal(np.array(got[..., :4].view(mx.uint16)), want_bits)
    assert mx.array_equal(got, _reference_rope(x, cos, sin), equal_nan=True).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_compressor_pooling_gives_the_same_bits_compiled_and_plain_for_every_shape(dtype):
    """engine/model/compressor.py's window pooling (gate softmax over a window's slots, weighted sum),
    compiled shapeless: the per-op bits for prefill's n windows and a decode batch's B, one trace for all;
    a -inf gate slot (an overlap before any window closed) weighs nothing."""
    from tessera.engine.model.compressor import _pool

    for step, (windows, slots) in enumerate([(1, 8), (13, 8), (3, 128), (16, 8), (1, 8)]):
        kv = (mx.random.normal((windows, slots, 32), key=mx.random.key(step)) * 2).astype(dtype)
        gate = (mx.random.normal((windows, slots, 32), key=mx.random.key(50 + step)) * 3).astype(dtype)
        gate = mx.concatenate([mx.full((windows, slots // 2, 32), -mx.inf, dtype=dtype), gate[:, slots // 2 :]], axis=1)
        outs = {}
        for enabled in (True, False):
            compiled.set_compile_enabled(enabled)
            outs[enabled] = _pool(kv, gate)
        weights = mx.softmax(gate.astype(mx.float32), axis=1, precise=True).astype(dtype)
        want = (kv * weights).sum(axis=1)
        assert outs[True].shape == (windows, 32) and outs[True].dtype == dtype
        assert mx.array_equal(outs[True], outs[False]).item() and mx.array_equal(outs[True], want).item(), (windows, slots)
        open_half = (kv[:, slots // 2 :] * weights[:, slots // 2 :]).sum(axis=1)
        assert mx.allclose(outs[True].astype(mx.float32), open_half.astype(mx.float32), rtol=2e-2, atol=1e-2).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_norms_give_the_same_bits_compiled_and_plain_for_every_shape(dtype):
    from tessera.engine.model.norms import rms_norm, unweighted_rms_norm

    for step, shape in enumerate([(1, 48), (7, 48), (3, 8, 48), (2, 64), (1, 48)]):  # rows, rank and width change
        weight = mx.random.normal((shape[-1],), key=mx.random.key(1)).astype(dtype)
        x = (mx.random.normal(shape, key=mx.random.key(step)) * 3).astype(dtype)
        outs = {}
        for enabled in (True, False):
            compiled.set_compile_enabled(enabled)
            outs[enabled] = (rms_norm(x, weight, EPS), unweighted_rms_norm(x, EPS))
        x32 = x.astype(mx.float32)
        want = (x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + EPS)).astype(dtype)
        for a, b in zip(outs[True], outs[False]):
            assert a.shape == shape and a.dtype == dtype and mx.array_equal(a, b).item(), shape
        assert mx.array_equal(outs[True][1], want).item()
        assert mx.allclose(outs[True][0].astype(mx.float32), (want.astype(mx.float32) * weight.astype(mx.float32)), rtol=1e-2).item()


@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "plain"])
def test_rope_tables_give_the_per_op_bits(enabled):
    """cos_sin (one fused function, tables shaped [L, 1, half, 1] and, sin signed (−1, 1), [L, 1, half, 2])
    against the per-op formula: the angles every rotation uses, on the plain and the YaRN table, over positions
    up to 1M."""
    from tessera.engine.model.config import RopeSpec
    from tessera.engine.model.rope import cos_sin, inv_freq

    compiled.set_compile_enabled(enabled)
    specs = [RopeSpec(theta=10000.0, dim=16), RopeSpec(theta=160000.0, dim=64, yarn_factor=16.0, yarn_original_max_positions=65536, attention_factor=0.5)]
    for spec in specs:
        for positions in (mx.array([5]), mx.arange(0, 1 << 20, 4099)):  # a decode row, a long prefill
            cos, signed_sin = cos_sin(spec, positions)
            freqs = positions.astype(mx.float32)[:, None] * inv_freq(spec)[None, :]
            want_cos, want_sin = mx.cos(freqs) * spec.attention_factor, mx.sin(freqs) * spec.attention_factor
            assert cos.shape == (positions.shape[0], 1, spec.dim // 2, 1)
            assert signed_sin.shape == (positions.shape[0], 1, spec.dim // 2, 2)
            assert mx.array_equal(cos.reshape(want_cos.shape), want_cos).item(), spec
            assert mx.array_equal(signed_sin[..., 1].reshape(want_sin.shape), want_sin).item(), spec
            assert mx.array_equal(signed_sin[..., 0].reshape(want_sin.shape), -want_sin).item(), spec


def test_decode_pieces_stay_within_their_node_budgets(tmp_path):
    """A decode step's time on a GPU goes with its primitive count (docs/BENCHMARKS.md, "Issue 14,
    session 6: primitives per decode step"): the rotation of a [1, H, D] query, a one-row mixed
    attention over window + selected rows, a layer's hyper-connection mixing and its expand keep
    the counts they were cut to (were 16, 24, 16 and 7 nodes)."""
    from tessera.engine.model.config import RopeSpec
    from tessera.engine.model.rope import apply_rope, rope_tables
    from tessera.kernels.sparse_attention import mixed_attention_reference

    compiled.set_compile_enabled(True)
    key = lambda i: mx.random.key(i)  # noqa: E731
    q = mx.random.normal((1, 4, 48), key=key(1))
    rows = [mx.random.normal((1, n, 48), key=key(2 + n)) for n in (8, 16)]
    valid = [mx.ones((1, n), dtype=mx.bool_) for n in (8, 16)]
    sinks = mx.random.normal((4,), key=key(3))
    streams = mx.random.normal((1, HC, WIDTH), key=key(4))
    w = _weights(mx.float32, 5)
    mx.eval(q, rows, valid, sinks, streams, w.fn_t32, w.base32, w.scale_per_mix)
    tables = rope_tables(RopeSpec(theta=10000.0, dim=16), mx.array([7]), 48)
    mx.eval(tables.cos, tables.signed_sin)
    assert _node_count([apply_rope(q, tables)], tmp_path / "rope.dot") <= 4
    assert _node_count([mixed_attention_reference(q, list(zip(rows, valid)), sinks, 0.1)], tmp_path / "attn.dot") <= 15
    post, mix_t, collapsed = hyper.hyper_weights(streams, w, ITERS, EPS, EPS)
    assert _node_count([post, collapsed], tmp_path / "hyper.dot") <= 14  # the Sinkhorn's nodes left out
    mx.eval(post, mix_t, collapsed)
    assert _node_count([hyper.expand(collapsed, streams, post, mix_t)], tmp_path / "expand.dot") <= 6


def test_hyper_connections_hand_the_mixing_kernel_its_operands_where_it_runs(monkeypatch):
    """Where kernels/hc_mix.py's kernel is supported (a CUDA decode batch), engine/model/hyper.py hands it the
    flattened streams, fn untransposed, each site's scales ([mixes] for a layer, [1] for the head) and the
    norm's eps. Here a float64 NumPy stand-in of the kernel's contract takes its place: the layer's and the
    head's collapse must come out as the reference's, within float32 rounding, with the stand-in called."""
    from tessera.kernels import hc_mix

    calls = []

    def stand_in(flat, fn32, scale, base32, norm_eps):
        rows, width = flat.shape
        mixes = fn32.shape[0]
        assert fn32.shape == (mixes, width) and base32.shape == (mixes,) and scale.shape in ((mixes,), (1,))
        calls.append(mixes)
        x = np.array(flat.astype(mx.float32), dtype=np.float64)
        normed = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + norm_eps)
        out = (normed @ np.array(fn32, dtype=np.float64).T) * np.array(scale, dtype=np.float64) + np.array(base32, dtype=np.float64)
        return mx.array(out.astype(np.float32))[..., None]

    monkeypatch.setattr(hyper.hc_mix_kernels, "is_supported", lambda flat: flat.shape[0] <= hc_mix.MAX_ROWS)
    monkeypatch.setattr(hyper.hc_mix_kernels, "mix_logits_kernel", stand_in)
    w = _weights(mx.float32, 1)
    head = (w.fn[:HC], w.base[:HC], w.scale[:1])
    streams = mx.random.normal((3, HC, WIDTH), key=mx.random.key(5))
    got = hyper.hyper_weights(streams, w, ITERS, EPS, EPS)
    post, comb, collapsed = reference_hyper_weights(streams, w, ITERS, EPS, EPS)
    for name, a, b in zip(("post", "mix_t", "collapsed"), got, (post, as_mix_t(comb, mx.float32), collapsed)):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-5).item(), name
    got_head = hyper.head_collapse(streams, hyper.HyperWeights(*head), EPS, EPS)
    assert mx.allclose(got_head, reference_head_collapse(streams, *head, EPS, EPS), rtol=1e-4, atol=1e-5).item()
    assert calls == [(2 + HC) * HC, HC]


# ---- the collapse after the mix logits (kernels/hc_collapse.py) ---------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "plain"])
def test_the_collapse_reference_is_the_engines_block_input_bit_for_bit(dtype, enabled):
    """kernels/hc_collapse.py's `collapse_reference` and `head_reference` (what its CUDA kernels are held to) are the
    engine's path where the kernels do not run: `hyper_weights` (`head_collapse`) and the block's norm, the same bits (the two eps values apart, so a swap
    shows)."""
    from tessera.kernels.hc_collapse import collapse_reference, head_reference
    from tessera.kernels.hc_mix import mix_logits_reference

    compiled.set_compile_enabled(enabled)
    w = _weights(dtype, 6)
    norm_weight = mx.random.uniform(0.5, 1.5, (WIDTH,), key=mx.random.key(7)).astype(dtype)
    for rows in (1, 5, 2):
        streams = mx.random.normal((rows, HC, WIDTH), key=mx.random.key(30 + rows)).astype(dtype)
        got = hyper.block_input(streams, w, norm_weight, ITERS, EPS, NORM_EPS)
        logits = mix_logits_reference(streams.reshape(rows, -1), w.fn_t32, w.scale_per_mix, w.base32, NORM_EPS)
        want = collapse_reference(logits, streams, norm_weight, ITERS, EPS, NORM_EPS)
        post, mix_t, collapsed = hyper.hyper_weights(streams, w, ITERS, EPS, NORM_EPS)
        normed = mx.fast.rms_norm(collapsed.astype(mx.float32), norm_weight.astype(mx.float32), NORM_EPS).astype(dtype)
        for name, a, b, c in zip(("post", "mix_t", "normed"), got, want, (post, mix_t, normed)):
            assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape, name
            assert mx.array_equal(a, b).item() and mx.array_equal(a, c).item(), f"{name} differs at {rows} rows"
        head = hyper.HyperWeights(w.fn[:HC], w.base[:HC], w.scale[:1])
        got_head = hyper.head_input(streams, head, norm_weight, EPS, NORM_EPS)
        head_logits = mix_logits_reference(streams.reshape(rows, -1), head.fn_t32, head.scale32, head.base32, NORM_EPS)
        want_head = head_reference(head_logits, streams, norm_weight, EPS, NORM_EPS)
        collapsed = hyper.head_collapse(streams, head, EPS, NORM_EPS)
        normed = mx.fast.rms_norm(collapsed.astype(mx.float32), norm_weight.astype(mx.float32), NORM_EPS).astype(dtype)
        assert got_head.dtype == dtype and mx.array_equal(got_head, want_head).item() and mx.array_equal(got_head, normed).item()


def test_a_model_hands_the_collapse_kernels_each_blocks_operands_where_they_run(tmp_path, monkeypatch):
    """Where the collapse kernels are supported (a CUDA decode batch), every collapse of a layer (attention's and the
    FFN's) and the head's hands them the mix logits, the streams and that block's norm weight with the config's
    iterations and eps values. Stand-ins with the references' contracts take their place here: the decode step's
    logits must be the bits of the path without them (a swapped eps would move them), with the layer's stand-in
    called twice a layer and the head's once."""
    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.model.loader import load_model
    from tessera.engine.tools.make_model import make_model
    from tessera.kernels import hc_collapse

    model = load_model(make_model(tmp_path / "m", "tiny", seed=3, with_tokenizer=False, rms_norm_eps=NORM_EPS), dtype="float32")
    cfg = model.cfg
    assert cfg.rms_norm_eps != cfg.hc_eps  # a swap of the two shows
    calls = []

    def stand_in(logits, streams, norm_weight, iters, hc_eps, norm_eps):
        assert logits.shape == (streams.shape[0], (2 + cfg.hc_mult) * cfg.hc_mult, 1) and logits.dtype == mx.float32
        assert (iters, hc_eps, norm_eps) == (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        calls.append(norm_weight.shape)
        return hc_collapse.collapse_reference(logits, streams, norm_weight, iters, hc_eps, norm_eps)

    def step_logits(cache):
        return model.forward([Segment(cache, [5])])

    caches = [model.new_cache(), model.new_cache()]
    for cache in caches:
        model.forward([Segment(cache, list(range(3, 20)))])
    want = step_logits(caches[0])
    def head_stand_in(logits, streams, norm_weight, hc_eps, norm_eps):
        assert logits.shape == (streams.shape[0], cfg.hc_mult, 1) and (hc_eps, norm_eps) == (cfg.hc_eps, cfg.rms_norm_eps)
        calls.append("head")
        return hc_collapse.head_reference(logits, streams, norm_weight, hc_eps, norm_eps)

    monkeypatch.setattr(hc_collapse, "is_supported", lambda streams: streams.shape[0] == 1)
    monkeypatch.setattr(hc_collapse, "collapse_kernel", stand_in)
    monkeypatch.setattr(hc_collapse, "head_kernel", head_stand_in)
    got = step_logits(caches[1])
    assert len(calls) == 2 * cfg.num_hidden_layers + 1 and calls[-1] == "head"
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


# ---- the expand, alone and with the MoE's sums (kernels/hc_expand.py) ---------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "plain"])
def test_the_expand_references_are_the_engines_bits(dtype, enabled):
    """kernels/hc_expand.py's references (what its CUDA kernels are held to) are the engine's path where they do not
    run: `expand_reference` is `hyper.expand` and the per-op formulation, and `expand_pairs_reference` is
    `hyper.expand_pairs` and `hyper.expand` of the MoE's output as `moe` sums it, the same bits."""
    from tessera.engine.model.moe import RoutedPairs
    from tessera.kernels.hc_expand import expand_pairs_reference, expand_reference, pairs_output

    compiled.set_compile_enabled(enabled)
    for rows, k in ((1, 6), (5, 2), (3, 6)):
        keys = iter(mx.random.split(mx.random.key(40 + rows), 8))
        streams = mx.random.normal((rows, HC, WIDTH), key=next(keys)).astype(dtype)
        block_out = (mx.random.normal((rows, WIDTH), key=next(keys)) * 3).astype(dtype)
        post = 2 * mx.sigmoid(mx.random.normal((rows, HC, 1), key=next(keys)))
        comb = mx.softmax(mx.random.normal((rows, HC, HC), key=next(keys)), axis=-1)
        mix_t = as_mix_t(comb, dtype)
        got = hyper.expand(block_out, streams, post, mix_t)
        want = expand_reference(block_out, streams, post, mix_t)
        assert got.dtype == dtype and mx.array_equal(got, want).item(), rows
        assert mx.array_equal(got, reference_expand(block_out, streams, post, comb)).item(), rows
        pairs = RoutedPairs(rows=mx.random.normal((rows * k, WIDTH), key=next(keys)).astype(dtype),
                            weights=mx.random.uniform(0, 1, (rows, k), key=next(keys)),
                            shared=mx.random.normal((rows, WIDTH), key=next(keys)).astype(dtype))
        assert mx.array_equal(pairs_output(pairs.rows, pairs.weights, pairs.shared), pairs.output(streams)).item()
        got = hyper.expand_pairs(pairs, streams, streams, post, mix_t)
        want = expand_pairs_reference(pairs.rows, pairs.weights, pairs.shared, streams, post, mix_t)
        assert got.dtype == dtype and mx.array_equal(got, want).item(), rows
        assert mx.array_equal(got, hyper.expand(pairs.output(streams), streams, post, mix_t)).item(), rows


@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hash"])
def test_moe_is_its_pairs_summed(hashed):
    """`moe` of a gathered-layout step is `moe_pairs` summed (`RoutedPairs.output`): the parts the expand kernel
    takes are the MoE's, bit for bit."""
    from tessera.engine.model.moe import MoEWeights, moe, moe_pairs

    experts, dim, inner, vocab, top_k = 6, 32, 24, 50, 2
    keys = iter(mx.random.split(mx.random.key(9), 10))
    normal = lambda shape: mx.random.normal(shape, key=next(keys)) * 0.3  # noqa: E731
    w = MoEWeights(
        router=normal((experts, dim)), correction_bias=None if hashed else normal((experts,)),
        tid2eid=mx.random.randint(0, experts, (vocab, top_k), key=next(keys)).astype(mx.uint32) if hashed else None,
        w1=normal((experts, inner, dim)), w2=normal((experts, dim, inner)), w3=normal((experts, inner, dim)),
        shared_w1=normal((inner, dim)), shared_w2=normal((dim, inner)), shared_w3=normal((inner, dim)),
    )
    for rows in (1, 4):
        x = mx.random.normal((rows, dim), key=mx.random.key(rows)) * 4
        ids = mx.arange(rows) % vocab
        pairs = moe_pairs(x, ids, w, top_k, 1.5, 0.7)
        assert pairs.rows.shape == (rows * top_k, dim) and pairs.weights.shape == (rows, top_k)
        assert mx.array_equal(pairs.output(x), moe(x, ids, w, top_k, 1.5, 0.7)).item(), rows


def test_a_model_hands_the_expand_kernels_each_blocks_operands_where_they_run(tmp_path, monkeypatch):
    """Where the expand kernels are supported (a CUDA decode batch), each layer's attention half hands `expand_kernel`
    its output and the collapse's post and mix_t, and its FFN half hands `expand_pairs_kernel` the MoE's pairs, weights
    and shared rows. Stand-ins with the references' contracts take their place here: the decode step's logits must be
    the bits of the path without them (a swapped post, a stale stream or a dropped shared expert would move them),
    each stand-in called once a layer."""
    from tessera.engine.model.deepseek_v4 import Segment
    from tessera.engine.model.loader import load_model
    from tessera.engine.tools.make_model import make_model
    from tessera.kernels import hc_expand

    model = load_model(make_model(tmp_path / "m", "tiny", seed=4, with_tokenizer=False), dtype="float32")
    cfg = model.cfg
    calls = []

    def stand_in(block_out, streams, post, mix_t):
        assert post.shape == (streams.shape[0], cfg.hc_mult, 1) and post.dtype == mx.float32
        calls.append("attention")
        return hc_expand.expand_reference(block_out, streams, post, mix_t)

    def pairs_stand_in(rows, weights, shared, streams, post, mix_t):
        assert weights.shape == (streams.shape[0], cfg.num_experts_per_tok) and rows.shape[0] == weights.size
        calls.append("ffn")
        return hc_expand.expand_pairs_reference(rows, weights, shared, streams, post, mix_t)

    caches = [model.new_cache(), model.new_cache()]
    for cache in caches:
        model.forward([Segment(cache, list(range(3, 20)))])
    want = model.forward([Segment(caches[0], [5])])
    decode = lambda streams: streams.shape[0] == 1  # noqa: E731
    monkeypatch.setattr(hc_expand, "is_supported", decode)
    monkeypatch.setattr(hc_expand, "block_out_is_supported", lambda block_out, streams: decode(streams))
    monkeypatch.setattr(hc_expand, "pairs_are_supported", lambda rows, weights, shared, streams: decode(streams))
    monkeypatch.setattr(hc_expand, "expand_kernel", stand_in)
    monkeypatch.setattr(hc_expand, "expand_pairs_kernel", pairs_stand_in)
    got = model.forward([Segment(caches[1], [5])])
    assert calls == ["attention", "ffn"] * cfg.num_hidden_layers
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
