"""The CUDA kernels against their plain-MLX references, on the device they run on. Skipped where MLX has no
CUDA device (an allowed skip: tests/skip_allowlist.txt); on a CUDA machine `pytest tests/test_kernels_cuda.py`
is the pass/fail form of `tessera check kernels`, with the same thresholds (engine/tools/check_limits.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.tools.check_limits import KERNEL_MAX_DIFFERING_ROWS, KERNEL_MAX_REL_DIFF
from tessera.kernels import device_checks, indexer_cuda, topk_cuda
from tessera.kernels.cuda import on_cuda
from tessera.kernels.indexer import indexer_scores_batched_reference, indexer_scores_reference, select_topk_reference

pytestmark = pytest.mark.skipif(not on_cuda(), reason="needs a CUDA device (MLX's CUDA build)")


def test_check_kernels_report_is_within_every_threshold():
    report = device_checks.check_indexer_kernel()
    assert report.get("kernel") != device_checks.UNAVAILABLE, report
    assert device_checks.kernel_failures(report, KERNEL_MAX_REL_DIFF, KERNEL_MAX_DIFFERING_ROWS) == [], report


@pytest.mark.parametrize("t,n", [(1, 7), (37, 1000), (256, 4099)])
def test_indexer_kernel_equals_the_reference_on_exact_inputs(t, n):
    """Integer-valued bf16 inputs: every product and sum is exact in fp32, so any difference is a bug."""
    rng = np.random.default_rng(t)
    q, w, keys, visible = device_checks._inputs(rng, t, n, 64, 128, integer=True)
    got = indexer_cuda.indexer_scores_kernel(q, w, keys, visible, 1.0)
    want = indexer_scores_reference(q, w, keys, visible, 1.0)
    assert mx.array_equal(got, want).item()


def _decode_batch(rng: np.random.Generator, counts: list[int], heads: int = 64, dim: int = 128, spare: int = 37):
    """One query row per sequence, each sequence's keys in a buffer with `spare` rows of garbage past them."""
    q = mx.array(rng.standard_normal((len(counts), heads, dim), dtype=np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((len(counts), heads), dtype=np.float32))
    buffers = [mx.array(rng.standard_normal((n + spare, dim), dtype=np.float32)).astype(mx.bfloat16) for n in counts]
    visible = mx.array([int(rng.integers(0, n + 1)) if i % 3 else n for i, n in enumerate(counts)], dtype=mx.int32)
    return q, w, buffers, visible


@pytest.mark.parametrize("counts", [[1], [300] * 16, [4099] * 5, [300, 1, 4099, 256, 257, 1000], [513] * 19],
                         ids=["one", "b16-same-n", "b5-long", "different-n", "b19-two-launches"])
def test_batched_indexer_kernel_equals_the_single_kernel_bit_for_bit(counts):
    """Each sequence of a decode batch gets the single kernel's bits on its own keys (random bf16 inputs:
    the same arithmetic in the same order, not merely close), and -inf past its key count."""
    q, w, buffers, visible = _decode_batch(np.random.default_rng(len(counts)), counts)
    got = indexer_cuda.indexer_scores_batched_kernel(q, w, buffers, counts, visible, 0.0883883)
    assert got.shape == (len(counts), max(counts))
    for b, n in enumerate(counts):
        alone = indexer_cuda.indexer_scores_kernel(q[b : b + 1], w[b : b + 1], buffers[b][:n], visible[b : b + 1], 0.0883883)
        assert mx.array_equal(got[b : b + 1, :n], alone).item(), b
        assert bool(mx.all(got[b, n:] == -mx.inf).item()), b


def test_decode_batch_scores_are_the_same_bits_with_the_batched_kernel_switched_off(monkeypatch):
    """The dispatch with TESSERA_DECODE_BATCH_KERNELS on (one launch) and off (one single-kernel launch
    per sequence) on cache buffers with spare capacity."""
    from tessera.engine.model.cache import RowBuffer
    from tessera.kernels import cuda
    from tessera.kernels.indexer import indexer_scores_batched

    counts = [700] * 16
    q, w, buffers, visible = _decode_batch(np.random.default_rng(3), counts)
    rows = [RowBuffer.holding(b[:n], n + 100) for b, n in zip(buffers, counts)]
    monkeypatch.setattr(cuda.decode_batch_kernels, "_enabled", True)
    on = indexer_scores_batched(q, w, rows, visible, 0.0883883)
    monkeypatch.setattr(cuda.decode_batch_kernels, "_enabled", False)
    off = indexer_scores_batched(q, w, rows, visible, 0.0883883)
    assert mx.array_equal(on, off).item()


def test_batched_indexer_kernel_equals_the_reference_on_exact_inputs():
    """Integer-valued inputs: the batched kernel equals `indexer_scores_batched_reference` exactly."""
    rng = np.random.default_rng(5)
    q, w, keys, visible = device_checks._inputs(rng, 6, 700, 64, 128, integer=True)
    key_sets = [keys[b * 100 : b * 100 + 100] for b in range(6)]  # [100, d] each
    want = indexer_scores_batched_reference(q, w, mx.stack(key_sets), mx.minimum(visible, 100), 1.0)
    got = indexer_cuda.indexer_scores_batched_kernel(q, w, key_sets, [100] * 6, mx.minimum(visible, 100), 1.0)
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("t,n,k", [(8, 100, 16), (64, 5000, 512), (16, 600, 512)])
def test_topk_kernel_selects_the_reference_rows_with_ties(t, n, k):
    scores, visible = device_checks._tie_scores(np.random.default_rng(n), t, n)
    scores, visible = mx.array(scores), mx.array(visible)
    got_rows, got_valid = topk_cuda.select_topk_kernel(scores, visible, k)
    want_rows, want_valid = select_topk_reference(scores, visible, k)
    assert mx.array_equal(got_valid, want_valid).item()
    assert mx.array_equal(got_rows, want_rows).item()  # as `check kernels` compares them


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("warp", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 37, 1000])
def test_sinkhorn_kernel_equals_the_ordered_reference(rows, warp, dtype, monkeypatch):
    """Round-to-nearest adds, divisions and the cast in the reference's order: the same bits, token by token, a
    thread per token or a lane per entry (TESSERA_SINKHORN_WARP; 1 to 3 and 16 tokens: a warp's two token groups
    half and wholly used, a decode batch), the eps added before and the result written transposed."""
    from tessera.kernels import sinkhorn
    from tessera.kernels.sinkhorn import mixing_kernel, mixing_ordered, mixing_reference

    monkeypatch.setattr(sinkhorn, "_warp_switch", sinkhorn.Switch("TESSERA_SINKHORN_WARP", default=warp))
    probs = mx.softmax(mx.random.normal((rows, 4, 4), key=mx.random.key(rows)) * 3, axis=-1)
    got = mixing_kernel(probs, 20, 1e-6, dtype)
    assert got.dtype == dtype and mx.array_equal(got, mixing_ordered(probs, 20, 1e-6, dtype)).item()
    want = mixing_reference(probs, 20, 1e-6, mx.float32)
    assert mx.allclose(got.astype(mx.float32), want, rtol=1e-5 if dtype == mx.float32 else 1e-2, atol=1e-7).item()
    assert mx.array_equal(mixing_kernel(probs[:1], 20, 1e-6, dtype), got[:1]).item()  # a row alone: the same bits


def _hc_collapse_inputs(rows: int, hidden: int, dtype, weight_dtype, seed: int = 0):
    rng = np.random.default_rng(seed + rows * 7 + hidden)
    logits = mx.array(rng.standard_normal((rows, 24, 1), dtype=np.float32) * 2)  # hc = 4: 4 pre, 4 post, 16 comb
    streams = mx.array(rng.standard_normal((rows, 4, hidden), dtype=np.float32) * 3).astype(dtype)
    weight = mx.array(rng.uniform(0.5, 1.5, (hidden,)).astype(np.float32)).astype(weight_dtype)
    return logits, streams, weight


@pytest.mark.parametrize("rows, hidden, dtype, weight_dtype", [
    (1, 4096, mx.bfloat16, mx.bfloat16), (16, 4096, mx.bfloat16, mx.float32), (3, 100, mx.bfloat16, mx.bfloat16),
    (64, 4096, mx.float32, mx.float32), (5, 4096, mx.float16, mx.float32),
], ids=["decode-1", "decode-16-f32-weight", "narrow", "max-rows-float32", "float16"])
def test_hc_collapse_kernel_is_the_reference_within_its_dtypes_rounding(rows, hidden, dtype, weight_dtype):
    """post, mix_t and the normed block input against the MLX composition they replace (kernels/hc_collapse.py
    `collapse_reference`), within `_assert_within_collapse_bound`'s bound; the normed input equal nearly everywhere in bf16 and fp16. A
    wrong eps, weight, transposition or mix order moves them far past."""
    from tessera.kernels.hc_collapse import collapse_kernel, collapse_reference, is_supported

    logits, streams, weight = _hc_collapse_inputs(rows, hidden, dtype, weight_dtype)
    assert is_supported(streams)
    got = collapse_kernel(logits, streams, weight, 20, 1e-6, 1e-6)
    want = collapse_reference(logits, streams, weight, 20, 1e-6, 1e-6)
    for name, a, b in zip(("post", "mix_t", "normed"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        _assert_within_collapse_bound(a, b, dtype, name)
    assert mx.allclose(got[1].astype(mx.float32).sum(axis=-1), mx.ones((rows, 4)), atol=1e-2).item()  # doubly stochastic


def _assert_within_collapse_bound(got: mx.array, want: mx.array, dtype, name: str) -> None:
    """The collapse kernels' results against their references: the kernels' sigmoid, exp and sums round apart from
    MLX's by an ulp of float32, which can tip a rounding to the streams' dtype (and a weighted sum with cancellation
    loses relative precision). bf16 and fp16: within two of the dtype's epsilons relative (and equal nearly
    everywhere for a normed row); float32: within 10⁻⁵ of 1 + |value| (20 Sinkhorn iterations deep)."""
    a, b = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (got, want))
    if dtype == mx.float32:
        bound = 1e-5 * (1 + np.abs(b))
    else:
        bound = 2 * (2.0**-7 if dtype == mx.bfloat16 else 2.0**-10) * np.abs(b) + 1e-6
        if name == "normed":
            assert np.mean(a == b) >= 0.98, name
    assert np.all(np.abs(a - b) <= bound), (name, float(np.max(np.abs(a - b) - bound)))


def test_hc_collapse_kernel_gives_a_token_the_same_bits_at_every_batch_size():
    """A token's outputs depend on its own row only (a block a token, sums in a fixed order)."""
    from tessera.kernels.hc_collapse import collapse_kernel

    logits, streams, weight = _hc_collapse_inputs(16, 4096, mx.bfloat16, mx.bfloat16)
    batch = collapse_kernel(logits, streams, weight, 20, 1e-6, 1e-6)
    for r in (0, 5, 15):
        alone = collapse_kernel(logits[r : r + 1], streams[r : r + 1], weight, 20, 1e-6, 1e-6)
        assert all(mx.array_equal(a, b[r : r + 1]).item() for a, b in zip(alone, batch)), r


@pytest.mark.parametrize("rows, dtype", [(1, mx.bfloat16), (16, mx.bfloat16), (4, mx.float32)])
def test_hc_collapse_head_kernel_is_the_reference_within_its_dtypes_rounding(rows, dtype):
    """The head's collapse (pre weights only, then the output norm) against `head_reference` within
    `_assert_within_collapse_bound`'s bound, and a token's same bits alone."""
    from tessera.kernels.hc_collapse import head_kernel, head_reference, is_supported

    logits, streams, weight = _hc_collapse_inputs(rows, 4096, dtype, dtype)
    logits = mx.array(np.array(logits)[:, :4])  # the head's hc pre mixes, a row-contiguous array as the mix kernel's
    assert is_supported(streams)
    got = head_kernel(logits, streams, weight, 1e-6, 1e-6)
    want = head_reference(logits, streams, weight, 1e-6, 1e-6)
    assert got.shape == want.shape and got.dtype == dtype
    _assert_within_collapse_bound(got, want, dtype, "normed")
    assert mx.array_equal(head_kernel(logits[-1:], streams[-1:], weight, 1e-6, 1e-6), got[-1:]).item()


def _hc_expand_inputs(rows: int, hidden: int, dtype, slots: int = 6, exact: bool = False, seed: int = 0):
    """(block_out, streams, post, mix_t, pair rows, weights, shared) at hc = 4. exact: small multiples of 1/4, so every
    product and sum is exact in float32 and only the roundings to the streams' dtype remain (the same in any order)."""
    rng = np.random.default_rng(seed + rows * 7 + hidden + slots)
    if exact:
        ints = lambda shape: rng.integers(-4, 5, shape).astype(np.float32)  # noqa: E731
        quarters = lambda shape, low, high: rng.integers(4 * low, 4 * high + 1, shape).astype(np.float32) / 4  # noqa: E731
        block_out, streams, rows_, shared = ints((rows, hidden)), ints((rows, 4, hidden)), ints((rows * slots, hidden)), ints((rows, hidden))
        post, mix_t, weights = quarters((rows, 4, 1), 0, 2), quarters((rows, 4, 4), -1, 1), quarters((rows, slots), 0, 1)
    else:
        normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
        block_out, streams, rows_, shared = normal(rows, hidden) * 3, normal(rows, 4, hidden), normal(rows * slots, hidden), normal(rows, hidden)
        post = 2 / (1 + np.exp(-normal(rows, 4, 1)))
        mix_t = rng.dirichlet(np.ones(4), (rows, 4)).astype(np.float32)
        weights = rng.uniform(0, 1, (rows, slots)).astype(np.float32)
    as_dtype = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    return (as_dtype(block_out), as_dtype(streams), mx.array(post), as_dtype(mix_t), as_dtype(rows_), mx.array(weights),
            as_dtype(shared))


def _assert_within_expand_bound(got: mx.array, want: mx.array, block_out, streams, post, mix_t, dtype) -> None:
    """The expand kernels against their references: MLX sums the [hc, hc] product (and the slots) in its own order,
    which can tip a rounding to the streams' dtype by a unit of the size of the sum's terms, not of the result's
    (the post-scaled output and the mixed streams can cancel). Float32 against a float64 evaluation instead: MLX's
    float32 matmul may run on TF32 (its MLX_ENABLE_TF32), whose 10-bit products the kernel does not make."""
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
    out, s, p, m = f64(block_out), f64(streams), f64(post), f64(mix_t)
    size = np.abs(p) * np.abs(out)[:, None, :] + np.abs(m) @ np.abs(s)  # [T, hc, D]
    a, b = f64(got), (p * out[:, None, :] + m @ s if dtype == mx.float32 else f64(want))
    eps = {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11, mx.float32: 2.0**-24}[dtype]
    assert np.all(np.abs(a - b) <= 4 * eps * size + 1e-30), float(np.max(np.abs(a - b) / (size + 1e-30)))
    if dtype != mx.float32:
        assert np.mean(a == b) >= 0.9


@pytest.mark.parametrize("rows, dtype", [(1, mx.bfloat16), (16, mx.bfloat16), (64, mx.bfloat16), (3, mx.float16),
                                         (5, mx.float32)])
def test_hc_expand_kernel_is_the_reference_within_its_dtypes_rounding(rows, dtype):
    """The attention half's expand (kernels/hc_expand.py) against `expand_reference` at V4 Flash's hidden 4096:
    within a rounding of its terms' size and equal nearly everywhere; bit for bit on exact inputs; a token alone
    gets its bits in the batch. A wrong post, a transposed mix_t or a stream's offset moves it far past."""
    from tessera.kernels.hc_expand import block_out_is_supported, expand_kernel, expand_reference

    block_out, streams, post, mix_t, *_ = _hc_expand_inputs(rows, 4096, dtype)
    assert block_out_is_supported(block_out, streams)
    got = expand_kernel(block_out, streams, post, mix_t)
    want = expand_reference(block_out, streams, post, mix_t)
    assert got.shape == want.shape == streams.shape and got.dtype == dtype
    _assert_within_expand_bound(got, want, block_out, streams, post, mix_t, dtype)
    assert mx.array_equal(expand_kernel(block_out[-1:], streams[-1:], post[-1:], mix_t[-1:]), got[-1:]).item()
    block_out, streams, post, mix_t, *_ = _hc_expand_inputs(rows, 4096, dtype, exact=True)
    assert mx.array_equal(expand_kernel(block_out, streams, post, mix_t),
                          expand_reference(block_out, streams, post, mix_t)).item()


@pytest.mark.parametrize("rows, hidden, slots, dtype", [(1, 4096, 6, mx.bfloat16), (16, 4096, 6, mx.bfloat16),
                                                        (4, 1000, 2, mx.bfloat16), (2, 4096, 8, mx.float32)],
                         ids=["decode-1", "decode-16", "narrow-top2", "float32-top8"])
def test_hc_expand_pairs_kernel_is_the_reference_within_its_dtypes_rounding(rows, hidden, slots, dtype):
    """The FFN half's expand with the MoE's sums in front (the pairs weighted and summed over the slots, rounded, the
    shared rows added) against `expand_pairs_reference`: within a rounding of its terms' size, equal nearly
    everywhere, bit for bit on exact inputs, and a token's same bits alone. A dropped shared row, a wrong slot's
    weight or the routed sum left unrounded moves it."""
    from tessera.kernels.hc_expand import expand_pairs_kernel, expand_pairs_reference, pairs_are_supported, pairs_output

    _, streams, post, mix_t, rows_, weights, shared = _hc_expand_inputs(rows, hidden, dtype, slots)
    assert pairs_are_supported(rows_, weights, shared, streams)
    got = expand_pairs_kernel(rows_, weights, shared, streams, post, mix_t)
    want = expand_pairs_reference(rows_, weights, shared, streams, post, mix_t)
    assert got.shape == want.shape == streams.shape and got.dtype == dtype
    _assert_within_expand_bound(got, want, pairs_output(rows_, weights, shared), streams, post, mix_t, dtype)
    one = (rows_[-slots:], weights[-1:], shared[-1:], streams[-1:], post[-1:], mix_t[-1:])
    assert mx.array_equal(expand_pairs_kernel(*one), got[-1:]).item()
    _, streams, post, mix_t, rows_, weights, shared = _hc_expand_inputs(rows, hidden, dtype, slots, exact=True)
    assert mx.array_equal(expand_pairs_kernel(rows_, weights, shared, streams, post, mix_t),
                          expand_pairs_reference(rows_, weights, shared, streams, post, mix_t)).item()


def _hc_mix_inputs(rows: int, hc: int, hidden: int, dtype, scales: int):
    rng = np.random.default_rng(rows * 7 + hidden)
    mixes = (2 + hc) * hc if scales == 3 else hc
    flat = mx.array(rng.standard_normal((rows, hc * hidden), dtype=np.float32) * 3).astype(dtype)
    fn = mx.array(rng.standard_normal((mixes, hc * hidden), dtype=np.float32) * 0.02)
    scale = mx.array(rng.uniform(0.5, 2.0, (mixes if scales == 3 else 1,)).astype(np.float32))
    base = mx.array(rng.standard_normal((mixes,), dtype=np.float32))
    return flat, fn, scale, base


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("rows, hc, hidden, scales", [(1, 4, 4096, 3), (16, 4, 4096, 3), (3, 4, 64, 3), (5, 4, 4096, 1),
                                                       (64, 2, 100, 3)],
                         ids=["decode-1", "decode-16", "narrow", "head", "max-rows-hc2"])
def test_hc_mix_kernel_is_the_reference_to_float32_rounding(rows, hc, hidden, scales, dtype):
    """The mixing logits against a float64 evaluation of the same math: within float32 rounding of the terms'
    magnitude (3·10⁻⁵: another summation order than the reference's, not other math). MLX's own product is
    held to TF32's (10⁻³): on the H200 its GEMM (2 rows and more) multiplies in TF32 and missed 3·10⁻⁵ at 3
    and 64 rows (docs/BENCHMARKS.md "Session 18"), so the kernel is the more precise of the two."""
    from tessera.kernels.hc_mix import mix_logits_kernel, mix_logits_reference

    flat, fn, scale, base = _hc_mix_inputs(rows, hc, hidden, dtype, scales)
    got = mix_logits_kernel(flat, fn, scale, base, 1e-6)
    x = np.array(flat.astype(mx.float32), dtype=np.float64)
    normed = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6)
    exact = (normed @ np.array(fn, dtype=np.float64).T) * np.array(scale, dtype=np.float64) + np.array(base, dtype=np.float64)
    bound = 3e-5 * (np.abs(normed) @ np.abs(np.array(fn, dtype=np.float64)).T + np.abs(np.array(base, dtype=np.float64)))
    assert got.shape == (rows, fn.shape[0], 1) and got.dtype == mx.float32
    assert np.all(np.abs(np.array(got)[..., 0] - exact) <= bound)
    reference = mix_logits_reference(flat, fn.T, scale, base, 1e-6)
    assert np.all(np.abs(np.array(reference)[..., 0] - exact) <= bound / 3e-5 * 1e-3)


def test_hc_mix_kernel_gives_a_token_the_same_bits_at_every_batch_size():
    """A token's logits depend on its own row only (a block per token and mix, sums in a fixed order)."""
    from tessera.kernels.hc_mix import mix_logits_kernel

    flat, fn, scale, base = _hc_mix_inputs(16, 4, 4096, mx.bfloat16, 3)
    batch = mix_logits_kernel(flat, fn, scale, base, 1e-6)
    for r in (0, 5, 15):
        alone = mix_logits_kernel(flat[r : r + 1], fn, scale, base, 1e-6)
        assert mx.array_equal(alone, batch[r : r + 1]).item(), r
    assert mx.array_equal(mix_logits_kernel(flat[:7], fn, scale, base, 1e-6), batch[:7]).item()


def _rms_norm_inputs(shape: tuple[int, ...], dtype, weight_dtype, seed: int = 0):
    rng = np.random.default_rng(seed + shape[-1])
    x = mx.array(rng.standard_normal(shape, dtype=np.float32) * 3).astype(dtype)
    weight = None if weight_dtype is None else mx.array(rng.uniform(0.5, 1.5, shape[-1:]).astype(np.float32)).astype(weight_dtype)
    return x, weight


@pytest.mark.parametrize("shape, dtype, weight_dtype", [
    ((1, 4096), mx.bfloat16, mx.float32),     # attention's and the FFN's norm at one token
    ((16, 4096), mx.bfloat16, mx.float32),
    ((3, 1536), mx.bfloat16, mx.bfloat16),    # q_a's, a bf16 weight
    ((16, 64, 512), mx.bfloat16, None),       # the heads' q, unweighted
    ((1000, 512), mx.bfloat16, mx.float32),   # a prefill chunk's kv rows
    ((5, 128), mx.float16, mx.float32),
    ((7, 8), mx.bfloat16, None),              # one piece a row
], ids=["hidden-1", "hidden-16", "q-lora-bf16-weight", "heads-unweighted", "many-rows", "float16", "narrow"])
def test_rms_norm_kernel_is_the_reference_to_the_rows_rounding(shape, dtype, weight_dtype, monkeypatch):
    """Against a float64 evaluation: within one rounding to the rows' dtype (the float32 statistics add ~10⁻⁷);
    against MLX's path (a cast, its norm, a cast back): at most one unit of the rows' dtype apart (its sums run in
    another order), and equal nearly everywhere. A wrong weight, eps or width would move every row far past both."""
    from tessera.kernels import rms_norm_cuda
    from tessera.kernels.rms_norm_cuda import is_supported, rms_norm_kernel, rms_norm_reference, unweighted_rms_norm_reference

    monkeypatch.setattr(rms_norm_cuda, "_switch", rms_norm_cuda.Switch(rms_norm_cuda.ENV_VAR, default=True))  # off by default
    x, weight = _rms_norm_inputs(shape, dtype, weight_dtype)
    assert is_supported(x)
    got = rms_norm_kernel(x, weight, 1e-6)
    want = unweighted_rms_norm_reference(x, 1e-6) if weight is None else rms_norm_reference(x, weight, 1e-6)
    x64 = np.array(x.astype(mx.float32), dtype=np.float64)
    exact = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + 1e-6)
    if weight is not None:
        exact = exact * np.array(weight.astype(mx.float32), dtype=np.float64)
    unit = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11  # the rows' dtype's relative spacing, halved: one rounding
    assert got.shape == x.shape and got.dtype == dtype
    got64, want64 = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (got, want))
    assert np.all(np.abs(got64 - exact) <= unit * np.abs(exact) * 1.01 + 1e-30), float(np.max(np.abs(got64 - exact) / np.abs(exact)))
    assert np.all(np.abs(got64 - want64) <= 2 * unit * np.abs(want64) + 1e-30)
    assert np.mean(got64 == want64) >= 0.99


def test_rms_norm_kernel_gives_a_row_the_same_bits_at_every_batch_size_and_any_offset():
    """A row's norm depends on its own row only (a warp a row, its sums in one order); a view that starts off 16
    bytes (the kernel's element loads) gives the same bits as the aligned buffer (its vector loads)."""
    from tessera.kernels.rms_norm_cuda import rms_norm_kernel

    x, weight = _rms_norm_inputs((16, 4096), mx.bfloat16, mx.float32)
    batch = rms_norm_kernel(x, weight, 1e-6)
    for r in (0, 5, 15):
        assert mx.array_equal(rms_norm_kernel(x[r : r + 1], weight, 1e-6), batch[r : r + 1]).item(), r
    assert mx.array_equal(rms_norm_kernel(x[:7], weight, 1e-6), batch[:7]).item()
    flat = mx.concatenate([mx.zeros((1,), dtype=mx.bfloat16), x.reshape(-1)])
    shifted = flat[1:].reshape(16, 4096)  # 2 bytes past the buffer's start
    assert mx.array_equal(rms_norm_kernel(shifted, weight, 1e-6), batch).item()


def _decode_attention_inputs(tokens: int, heads: int, dim: int, counts: tuple[int, ...], shared_last: bool, dtype):
    """q [T, H, d]; groups of (rows [T, R, d], valid [T, R]) with about a fifth of the rows invalid, each invalid
    row 6× larger than a valid one (attended, it would take most of its token's weight); sinks [H] from 2 to 7,
    a fifth to most of a token's weight. `shared_last`: the last group one set of rows every token sees, broadcast (HCA's form)."""
    rng = np.random.default_rng(tokens * 131 + dim + sum(counts))
    q = mx.array(rng.standard_normal((tokens, heads, dim), dtype=np.float32)).astype(dtype)
    groups = []
    for g, count in enumerate(counts):
        shared = shared_last and g == len(counts) - 1
        shape = (1 if shared else tokens, count, dim)
        valid = rng.random(shape[:2]) > 0.2
        rows = rng.standard_normal(shape, dtype=np.float32) * np.where(valid, 1.0, 6.0)[..., None]
        rows, valid = mx.array(rows).astype(dtype), mx.array(valid)
        if shared:
            rows, valid = mx.broadcast_to(rows, (tokens, count, dim)), mx.broadcast_to(valid, (tokens, count))
        groups.append((rows, valid))
    sinks = mx.array(rng.uniform(2.0, 7.0, (heads,)).astype(np.float32))  # a sink takes up to most of a weight
    return q, groups, sinks


def _attention_float64(q, groups, sinks, scale):
    """The mixed attention's math without any rounding -> (out [T, H, d], Σ_r p_r |row_r| [T, H, d]: the terms' size)."""
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
    qs = f64(q)
    rows = np.concatenate([f64(r) for r, _ in groups], axis=1)  # [T, R, d]
    valid = np.concatenate([np.array(v) for _, v in groups], axis=1)  # [T, R]
    logits = np.where(valid[:, None, :], np.einsum("thd,trd->thr", qs, rows) * scale, -np.inf)
    sink = np.broadcast_to(np.array(sinks, dtype=np.float64)[None, :, None], logits.shape[:2] + (1,))
    both = np.concatenate([logits, sink], axis=-1)
    p = np.exp(both - both.max(axis=-1, keepdims=True))
    p = (p / p.sum(axis=-1, keepdims=True))[..., :-1]
    return np.einsum("thr,trd->thd", p, rows), np.einsum("thr,trd->thd", p, np.abs(rows))


@pytest.mark.parametrize("tokens, heads, dim, counts, shared_last, dtype", [
    (1, 64, 512, (128, 512), False, mx.bfloat16),   # a CSA layer of V4 Flash at one token
    (16, 64, 512, (128, 512), False, mx.bfloat16),  # a batch
    (3, 64, 512, (128, 640), True, mx.bfloat16),    # HCA: every token's compressed rows the same, broadcast
    (5, 16, 256, (128,), False, mx.bfloat16),       # a window layer: one group
    (2, 16, 1024, (7, 1780), False, mx.bfloat16),   # rows not a multiple of the tiles' 16, a wide head
    (2, 128, 512, (128, 1664), False, mx.bfloat16),  # MAX_ATTENDED rows, MAX_HEADS
    (4, 32, 256, (128, 300), False, mx.float16),
], ids=["csa-1", "csa-16", "hca-shared", "window", "odd-rows", "max-rows", "float16"])
def test_decode_attention_kernel_is_the_mixed_attention_to_the_rows_rounding(tokens, heads, dim, counts, shared_last, dtype):
    """Against a float64 evaluation of the same math: within what rounding the products, the probabilities and the
    output to the rows' dtype can move it (bf16: the logits' rounding moves a probability by up to ~1 %; fp16:
    ~10⁻³). The reference (MLX, cuBLAS) is held to the same bound, and the two to twice it. Invalid rows are 6×
    larger, so attending one would move its token far past the bound; a wrong sink, row or head likewise."""
    from tessera.kernels.decode_attention_cuda import decode_attention_kernel, is_supported
    from tessera.kernels.sparse_attention import mixed_attention_reference

    q, groups, sinks = _decode_attention_inputs(tokens, heads, dim, counts, shared_last, dtype)
    scale = dim**-0.5
    assert is_supported(q, groups)
    got = decode_attention_kernel(q, groups, sinks, scale)
    want = mixed_attention_reference(q, groups, sinks, scale)
    exact, size = _attention_float64(q, groups, sinks, scale)
    rel = 2e-2 if dtype == mx.bfloat16 else 4e-3
    out_ulp = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    bound = rel * size + out_ulp * np.abs(exact) + 1e-30
    assert got.shape == q.shape and got.dtype == dtype
    got64, want64 = np.array(got.astype(mx.float32), dtype=np.float64), np.array(want.astype(mx.float32), dtype=np.float64)
    assert np.all(np.abs(want64 - exact) <= bound), "the reference itself is outside the bound: the bound is wrong"
    assert np.all(np.abs(got64 - exact) <= bound), float(np.max(np.abs(got64 - exact) / bound))
    assert np.all(np.abs(got64 - want64) <= 2 * bound)


@pytest.mark.parametrize("block_heads", [None, 16, 32])
def test_decode_attention_kernel_gives_a_token_the_same_bits_at_every_batch_size(block_heads, monkeypatch):
    """A token's output depends on its own rows only: each block reads one token's data, and its sums have one order
    whatever the tokens a call — and whatever the output kernel's heads a block (a probe compares those layouts:
    each (16 heads, 32 columns) tile's sums run in the same order in all of them); the batch also within the
    float64 bound."""
    from tessera.kernels import decode_attention_cuda
    from tessera.kernels.decode_attention_cuda import decode_attention_kernel

    q, groups, sinks = _decode_attention_inputs(16, 64, 512, (128, 512), False, mx.bfloat16)
    default = decode_attention_kernel(q, groups, sinks, 512**-0.5)
    monkeypatch.setattr(decode_attention_cuda, "_forced_block_heads", block_heads)
    batch = decode_attention_kernel(q, groups, sinks, 512**-0.5)
    assert mx.array_equal(batch, default).item()
    for a, b in ((0, 1), (7, 8), (15, 16), (3, 9), (2, 5)):
        part = decode_attention_kernel(q[a:b], [(r[a:b], v[a:b]) for r, v in groups], sinks, 512**-0.5)
        assert mx.array_equal(part, batch[a:b]).item(), (a, b)
    exact, size = _attention_float64(q, groups, sinks, 512**-0.5)
    got = np.array(batch.astype(mx.float32), dtype=np.float64)
    assert np.all(np.abs(got - exact) <= 2e-2 * size + 2.0**-8 * np.abs(exact) + 1e-30)


@pytest.mark.parametrize("dtype, width", [(mx.bfloat16, 4096), (mx.float32, 128), (mx.bfloat16, 8)])
def test_row_gather_kernel_is_mlx_gather_bit_for_bit(dtype, width):
    """A gather is a copy: the 16-byte-vector kernel gives exactly MLX's x[idx] (repeats, any order,
    more rows out than in)."""
    from tessera.kernels.row_gather import is_supported, take_rows_kernel, take_rows_reference

    x = mx.random.normal((300, width), key=mx.random.key(width)).astype(dtype)
    idx = mx.random.randint(0, 300, (1000,), key=mx.random.key(1)).astype(mx.uint32)
    assert is_supported(x, idx)
    assert mx.array_equal(take_rows_kernel(x, idx), take_rows_reference(x, idx)).item()
    view = x[100:]  # a view starting at a row boundary
    assert mx.array_equal(take_rows_kernel(view, idx % 200), take_rows_reference(view, idx % 200)).item()


# --- the padded MoE layout's kernels (kernels/moe_padded.py) -----------------------------------------

@pytest.fixture
def moe_kernels_on():
    """Both padded-layout kernels switched on (their `*_is_supported` checks read the switches), then back."""
    from tessera.kernels import moe_padded

    saved = moe_padded.combine_kernel_enabled(), moe_padded.index_kernel_enabled()
    moe_padded.set_combine_kernel_enabled(True)
    moe_padded.set_index_kernel_enabled(True)
    yield
    moe_padded.set_combine_kernel_enabled(saved[0])
    moe_padded.set_index_kernel_enabled(saved[1])


def _combine_inputs(dtype, width, k, tokens=300, num_rows=700):
    """Rows of mixed sign and magnitudes 1e-3 … 1e3 (so that the summation order shows in the bits),
    slots with repeats in any order, weights in [0.01, 2)."""
    rng = np.random.default_rng(width + k)
    rows = rng.standard_normal((num_rows, width)) * 10.0 ** rng.integers(-3, 4, (num_rows, 1))
    rows[::7] = -0.0  # signed zeros: the sum starts from +0 (0 + -0 = +0), which shows in the bits
    slot = rng.integers(0, num_rows, tokens * k).astype(np.int32)
    weights = rng.uniform(0.01, 2.0, (tokens, k)).astype(np.float32)
    return mx.array(rows.astype(np.float32)).astype(dtype), mx.array(slot), mx.array(weights)


@pytest.mark.parametrize("dtype, width, k", [(mx.bfloat16, 4096, 6), (mx.float32, 128, 6), (mx.float16, 64, 4),
                                             (mx.bfloat16, 8, 2), (mx.bfloat16, 256, 8)])
def test_moe_combine_kernel_equals_the_gather_and_weighted_sum_bit_for_bit(dtype, width, k, moe_kernels_on):
    """One kernel for take_rows + reshape + weighted_sum: MLX's sum over the k slots is col_reduce_small
    (products rounded, then added onto 0 in slot order), and the kernel must give exactly its bits."""
    from tessera.kernels.moe_padded import combine_is_supported, combine_rows_kernel, combine_rows_reference, weighted_sum

    rows, slot, weights = _combine_inputs(dtype, width, k)
    assert combine_is_supported(rows, slot, weights)
    got = combine_rows_kernel(rows, slot, weights)
    assert got.dtype == mx.float32 and got.shape == (weights.shape[0], width)
    assert _same_bits(got, combine_rows_reference(rows, slot, weights))
    plain = weighted_sum(rows[slot].reshape(weights.shape[0], k, width), weights)  # MLX's own gather
    assert _same_bits(got, plain)
    if k > 2:  # the test can see the order: the slots summed backwards give other bits somewhere
        backwards = weighted_sum(rows[slot].reshape(weights.shape[0], k, width)[:, ::-1], weights[:, ::-1])
        assert not mx.array_equal(got, backwards).item()
    view = rows[100:]  # a view starting at a row boundary; uint32 slots; bf16 weights
    slot_u = (slot % (rows.shape[0] - 100)).astype(mx.uint32)
    w16 = weights.astype(mx.bfloat16)
    assert _same_bits(combine_rows_kernel(view, slot_u, w16), combine_rows_reference(view, slot_u, w16))


def _same_bits(a: mx.array, b: mx.array) -> bool:
    """Arrays of one float dtype equal bit for bit (array_equal takes -0.0 == 0.0)."""
    assert a.dtype == b.dtype
    as_int = {mx.float32: mx.uint32, mx.bfloat16: mx.uint16, mx.float16: mx.uint16}[a.dtype]
    return mx.array_equal(a.view(as_int), b.view(as_int)).item()


def _index_case(skewed: bool, overflow: bool):
    """(order, flat, counts, plan, k) for 4,096 tokens × top-6 over 256 experts (skewed: 20 % drawn 4×)."""
    from tessera.engine.model import moe as moe_mod

    rng = np.random.default_rng(7 + skewed)
    tokens, k, experts = 4096, 6, 256
    p = np.where(np.arange(experts) < experts // 5, 4.0, 1.0) if skewed else np.ones(experts)
    flat = np.stack([rng.choice(experts, k, replace=False, p=p / p.sum()) for _ in range(tokens)]).reshape(-1).astype(np.int32)
    counts = np.bincount(flat, minlength=experts)
    cost = moe_mod.OverflowCost(0.0, 1.0) if overflow else None
    plan = moe_mod.plan_padded(counts, cost)
    assert (len(plan.overflow) > 0) == overflow
    flat = mx.array(flat)
    return mx.argsort(flat), flat, counts, plan, k


@pytest.mark.parametrize("skewed, overflow", [(False, False), (True, False), (True, True)])
def test_moe_index_kernel_equals_the_reference_tables(skewed, overflow, moe_kernels_on):
    """The padded layout's index tables from one kernel: the same integers as the host tables + gather,
    division and scatter (padding rows included: they read sorted position 0's token in both)."""
    from tessera.engine.model import moe as moe_mod
    from tessera.kernels.moe_padded import index_is_supported, padded_indices_kernel

    order, flat, counts, plan, k = _index_case(skewed, overflow)
    device_counts = mx.array(counts.astype(np.int32))
    assert index_is_supported(order, flat, device_counts)
    tokens, slot = padded_indices_kernel(order, flat, device_counts, plan.capacity, plan.overflow_capacity, plan.rows(len(counts)), k)
    want_tokens, want_slot = moe_mod.padded_indices_reference(order, counts, plan, k)
    assert np.array_equal(np.array(tokens), np.array(want_tokens).astype(np.int32))
    assert np.array_equal(np.array(slot), np.array(want_slot))


@pytest.mark.parametrize("skewed", [False, True])
def test_padded_layout_gives_the_same_bits_with_and_without_its_kernels(skewed):
    """routed_experts through the padded layout, bf16, with the combine and index kernels and with both
    switched off (the plain-MLX references): the same bits."""
    from tessera.engine.model import moe as moe_mod
    from tessera.kernels import moe_padded

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
    chosen = mx.array(chosen)

    def outputs():
        return moe_mod.routed_experts(x, chosen, weights, w, 10.0, layout="padded")

    saved = moe_padded.combine_kernel_enabled(), moe_padded.index_kernel_enabled()
    try:
        moe_padded.set_combine_kernel_enabled(True)  # explicit: the environment may have switched them off
        moe_padded.set_index_kernel_enabled(True)
        with_kernels = outputs()
        moe_padded.set_combine_kernel_enabled(False)
        moe_padded.set_index_kernel_enabled(False)
        without = outputs()
    finally:
        moe_padded.set_combine_kernel_enabled(saved[0])
        moe_padded.set_index_kernel_enabled(saved[1])
    assert float(mx.abs(without).max()) > 0.01
    assert _same_bits(with_kernels, without)


@pytest.mark.parametrize("num_seqs, width", [(1, 512), (16, 512), (19, 64)])
def test_batched_row_gather_kernel_is_each_buffers_gather(num_seqs, width, monkeypatch):
    """Decode's selected rows: one launch (per 16 sequences) over every sequence's own buffer gives
    exactly MLX's per-buffer x[idx] (a copy), whatever the buffers' capacities."""
    from tessera.kernels import row_gather
    from tessera.kernels.row_gather import batch_is_supported, take_rows_batched_kernel, take_rows_batched_reference

    monkeypatch.setattr(row_gather._batch_switch, "_enabled", True)  # whatever the environment says

    xs = [mx.random.normal((300 + 7 * b, width), key=mx.random.key(b)).astype(mx.bfloat16) for b in range(num_seqs)]
    idx = mx.sort(mx.random.randint(0, 300, (num_seqs, 512), key=mx.random.key(99)), axis=-1).astype(mx.int32)
    assert batch_is_supported(xs, idx)
    assert mx.array_equal(take_rows_batched_kernel(xs, idx), take_rows_batched_reference(xs, idx)).item()


def _kernel_switched_on(module):
    """A kernel module's switch on for one test (the environment may have turned it off), restored after."""
    saved = module.kernel_enabled()
    module.set_kernel_enabled(True)
    yield
    module.set_kernel_enabled(saved)


# --- mxfp4 experts, one row per pair (kernels/gather_qmv.py) --------------------------------------------

@pytest.fixture
def gather_qmv_on():
    """The kernel on, its tensor-core variant as the test sets it (off unless set), both restored after."""
    from tessera.kernels import gather_qmv

    saved = gather_qmv.mma_enabled()
    gather_qmv.set_mma_enabled(False)
    yield from _kernel_switched_on(gather_qmv)
    gather_qmv.set_mma_enabled(saved)


# (dtype, the tensor-core variant on): it takes bf16 rows only
_QMV_VARIANTS = [(mx.float32, False), (mx.bfloat16, False), (mx.bfloat16, True)]


def _mxfp4_experts(rng: np.random.Generator, experts: int, n: int, k: int, scale_spread: int):
    """Packed mxfp4 experts made directly (random 4-bit codes, E8M0 scales 127 ± scale_spread): their values
    are exactly the E2M1 grid times powers of two, whatever MLX's quantizer would pick."""
    values = rng.integers(0, 2**32, (experts, n, k // 8), dtype=np.uint64).astype(np.uint32)
    scales = rng.integers(127 - scale_spread, 128 + scale_spread, (experts, n, k // 32)).astype(np.uint8)
    return mx.array(values), mx.array(scales)


@pytest.mark.parametrize("dtype, mma", _QMV_VARIANTS)
@pytest.mark.parametrize("pairs, n, k", [(1, 32, 1024), (6, 128, 2048), (96, 64, 4096)])
def test_gather_qmv_kernel_equals_gather_qmm_on_exact_inputs(dtype, mma, pairs, n, k, gather_qmv_on):
    """Integer x in [-8, 8] and scales 2^-2 … 2^2: every product and partial sum is exact in float32, so the
    kernel's sums (another order than MLX's) must give the reference's bits."""
    from tessera.kernels import gather_qmv
    from tessera.kernels.gather_qmv import gather_qmv_kernel, gather_qmv_reference, is_supported

    gather_qmv.set_mma_enabled(mma)
    rng = np.random.default_rng(pairs + n + k)
    values, scales = _mxfp4_experts(rng, 8, n, k, scale_spread=2)
    x = mx.array(rng.integers(-8, 9, (pairs, k)).astype(np.float32)).astype(dtype)
    experts = mx.array(rng.integers(0, 8, pairs).astype(np.uint32))
    assert is_supported(x.dtype, k, values)
    got = gather_qmv_kernel(x, values, scales, experts)
    assert got.dtype == dtype and got.shape == (pairs, n)
    assert _same_bits(got, gather_qmv_reference(x, values, scales, experts))


@pytest.mark.parametrize("dtype, mma", _QMV_VARIANTS)
def test_gather_qmv_kernel_decodes_every_code_and_scale(dtype, mma, gather_qmv_on):
    """One-hot x rows pick single weights: each output is one dequantized weight, so all sixteen E2M1 codes
    (both zeros) under scales 2^-12 … 2^12 (the tensor-core variant's second multiply above 2^1) must come out as
    MLX dequantizes them."""
    from tessera.kernels import gather_qmv
    from tessera.kernels.gather_qmv import gather_qmv_kernel, gather_qmv_reference

    gather_qmv.set_mma_enabled(mma)
    rng = np.random.default_rng(12)
    values, scales = _mxfp4_experts(rng, 4, 256, 1024, scale_spread=12)
    hot = rng.choice(1024, 64, replace=False)
    x = np.zeros((64, 1024), dtype=np.float32)
    x[np.arange(64), hot] = 1.0
    x = mx.array(x).astype(dtype)
    experts = mx.array(rng.integers(0, 4, 64).astype(np.uint32))
    assert _same_bits(gather_qmv_kernel(x, values, scales, experts), gather_qmv_reference(x, values, scales, experts))


@pytest.mark.parametrize("dtype, mma", _QMV_VARIANTS)
def test_gather_qmv_kernel_is_close_to_gather_qmm_and_row_invariant(dtype, mma, gather_qmv_on):
    """Normal x at V4 Flash's expert widths: within the output's rounding of the reference; and a row's bits
    do not depend on the rows beside it."""
    from tessera.kernels import gather_qmv
    from tessera.kernels.gather_qmv import gather_qmv_kernel, gather_qmv_reference

    gather_qmv.set_mma_enabled(mma)
    rng = np.random.default_rng(3)
    values, scales = _mxfp4_experts(rng, 8, 2048, 4096, scale_spread=8)
    x = mx.array(rng.standard_normal((96, 4096)).astype(np.float32)).astype(dtype)
    experts = mx.array(rng.integers(0, 8, 96).astype(np.uint32))
    got = np.array(gather_qmv_kernel(x, values, scales, experts).astype(mx.float32))
    want = np.array(gather_qmv_reference(x, values, scales, experts).astype(mx.float32))
    # bf16 outputs: a rounding apart; float32: MLX's float32 GEMM may run on TF32 tensor cores (10-bit mantissa)
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=2.0**-10 * float(np.abs(want).max()))
    alone = gather_qmv_kernel(x[37:38], values, scales, experts[37:38])
    assert _same_bits(alone, gather_qmv_kernel(x, values, scales, experts)[37:38])


def test_the_gathered_moe_runs_the_gather_qmv_kernel_when_it_is_on(gather_qmv_on, monkeypatch):
    """engine/model/moe.py's one-row-per-pair path takes the kernel for mxfp4 experts, and the MoE's output
    stays within rounding of gather_qmm's."""
    from tessera.engine.model import moe as moe_mod
    from tessera.engine.model.quantized import QuantizedWeight
    from tessera.kernels import gather_qmv

    rng = np.random.default_rng(5)
    values, scales = _mxfp4_experts(rng, 8, 256, 1024, scale_spread=4)
    w = QuantizedWeight(values, scales, None, "mxfp4", 4, 32)
    x = mx.array(rng.standard_normal((12, 1, 1024)).astype(np.float32)).astype(mx.bfloat16)
    experts = mx.array(np.sort(rng.integers(0, 8, 12)).astype(np.uint32))
    calls = []
    real = gather_qmv.gather_qmv_kernel
    monkeypatch.setattr(moe_mod, "gather_qmv_kernel", lambda *a: calls.append(a[0].shape) or real(*a))
    got = np.array(moe_mod._gather_linear(x, w, experts).astype(mx.float32))
    assert calls == [(12, 1024)]
    gather_qmv.set_kernel_enabled(False)
    want = np.array(moe_mod._gather_linear(x, w, experts).astype(mx.float32))
    assert got.shape == want.shape == (12, 1, 256)
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=2**-6 * float(np.abs(want).max()))


@pytest.mark.parametrize("mma", [False, True])
def test_a_decode_steps_pairs_in_order_give_the_sorted_pairs_bits(mma, gather_qmv_on):
    """engine/model/moe.py skips the expert sort for a decode step's pairs through the kernel
    (`_pairs_in_order`): a row's result must not depend on where its pair sits, so both orders give the same
    bits, pair by pair (V4 Flash's expert widths, 16 tokens at top-6 over 256 experts)."""
    from tessera.engine.model import moe as moe_mod
    from tessera.engine.model.moe import MoEWeights
    from tessera.engine.model.quantized import QuantizedWeight
    from tessera.kernels import gather_qmv

    gather_qmv.set_mma_enabled(mma)
    rng = np.random.default_rng(7)
    experts_n, dim, inter, top_k, tokens = 256, 4096, 2048, 6, 16

    def weight(n: int, k: int) -> QuantizedWeight:
        return QuantizedWeight(*_mxfp4_experts(rng, experts_n, n, k, scale_spread=6), None, "mxfp4", 4, 32)

    w = MoEWeights(router=None, correction_bias=None, tid2eid=None, w1=weight(inter, dim), w2=weight(dim, inter),
                   w3=weight(inter, dim), shared_w1=None, shared_w2=None, shared_w3=None)
    x = mx.array(rng.standard_normal((tokens, dim)).astype(np.float32) * 0.1).astype(mx.bfloat16)
    flat = mx.array(rng.integers(0, experts_n, tokens * top_k).astype(np.int32))
    calls = []
    real = moe_mod._pairs_in_order
    moe_mod._pairs_in_order = lambda *a: calls.append(1) or real(*a)
    try:
        in_order = moe_mod.gathered_pairs(x, flat, mx.argsort(flat), top_k, w, 7.0)  # 96 pairs <= 256 experts
    finally:
        moe_mod._pairs_in_order = real
    assert calls == [1]
    assert _same_bits(in_order, moe_mod._pairs_sorted(x, flat, mx.argsort(flat), top_k, w, 7.0))


@pytest.mark.parametrize("dtype, mma", _QMV_VARIANTS)
def test_gather_qmv_kernel_reads_a_tokens_row_for_its_pairs_as_the_repeated_rows(dtype, mma, gather_qmv_on):
    """rows_per_x = 6: pair p reads row p // 6 (engine/model/moe.py's decode step: a token's top-6 without a
    repeat), the same bits as the rows repeated."""
    from tessera.kernels import gather_qmv
    from tessera.kernels.gather_qmv import gather_qmv_kernel

    gather_qmv.set_mma_enabled(mma)
    rng = np.random.default_rng(4)
    values, scales = _mxfp4_experts(rng, 32, 2048, 4096, scale_spread=6)
    tokens = mx.array(rng.standard_normal((16, 4096)).astype(np.float32)).astype(dtype)
    experts = mx.array(rng.integers(0, 32, 96).astype(np.uint32))
    got = gather_qmv_kernel(tokens, values, scales, experts, rows_per_x=6)
    assert got.shape == (96, 2048)
    assert _same_bits(got, gather_qmv_kernel(mx.repeat(tokens, 6, axis=0), values, scales, experts))


# --- mxfp8 projections, a decode batch's rows (kernels/mxfp8_qmv.py) ------------------------------------

@pytest.fixture
def mxfp8_qmv_on():
    from tessera.kernels import mxfp8_qmv

    yield from _kernel_switched_on(mxfp8_qmv)


_E4M3_FINITE = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)  # every code but NaN
# Exponent fields 6..9 (magnitudes 0.5 … 15) and zero: with scales 2^±1 and integer x in [-8, 8], every
# product is a multiple of 2^-5 below 2^7, so sums over K ≤ 4096 stay exact in float32.
_E4M3_NARROW = np.array([0] + [s << 7 | e << 3 | m for s in (0, 1) for e in range(6, 10) for m in range(8)], dtype=np.uint8)


def _mxfp8_weight(rng: np.random.Generator, groups: int, n: int, k: int, codes: np.ndarray, scale_spread: int):
    """Packed mxfp8 [G, N, K] made directly from E4M3 codes (MLX's layout: four codes a uint32, element 0 in
    the low byte) and E8M0 scales 127 ± scale_spread."""
    values = rng.choice(codes, (groups, n, k)).view(np.uint32)  # [G, N, K / 4]
    scales = rng.integers(127 - scale_spread, 128 + scale_spread, (groups, n, k // 32)).astype(np.uint8)
    return mx.array(values), mx.array(scales)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("groups, rows, n, k", [(1, 2, 512, 512), (1, 16, 1536, 4096), (8, 5, 64, 4096), (1, 9, 256, 1024)])
def test_mxfp8_qmv_kernel_equals_the_reference_on_exact_inputs(dtype, groups, rows, n, k, mxfp8_qmv_on):
    """Sums exact in float32 (`_E4M3_NARROW`): the kernel's order differs from MLX's, the bits may not."""
    from tessera.kernels.mxfp8_qmv import mxfp8_qmv_kernel, mxfp8_qmv_reference

    rng = np.random.default_rng(groups + rows + n + k)
    values, scales = _mxfp8_weight(rng, groups, n, k, _E4M3_NARROW, scale_spread=1)
    x = mx.array(rng.integers(-8, 9, (groups, rows, k)).astype(np.float32)).astype(dtype)
    got = mxfp8_qmv_kernel(x, values, scales)
    assert got.dtype == dtype and got.shape == (groups, rows, n)
    assert _same_bits(got, mxfp8_qmv_reference(x, values, scales))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mxfp8_qmv_kernel_decodes_every_e4m3_code_and_scale(dtype, mxfp8_qmv_on):
    """One-hot x rows pick single weights: each output is one dequantized weight, so every finite code
    (subnormals, both zeros, the largest) and scales 2^±8 must come out as MLX dequantizes them."""
    from tessera.kernels.mxfp8_qmv import mxfp8_qmv_kernel, mxfp8_qmv_reference

    rng = np.random.default_rng(11)
    values, scales = _mxfp8_weight(rng, 1, 512, 512, _E4M3_FINITE, scale_spread=8)
    hot = rng.choice(512, 16, replace=False)
    x = np.zeros((1, 16, 512), dtype=np.float32)
    x[0, np.arange(16), hot] = 1.0
    x = mx.array(x).astype(dtype)
    assert _same_bits(mxfp8_qmv_kernel(x, values, scales), mxfp8_qmv_reference(x, values, scales))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mxfp8_qmv_kernel_is_close_to_the_reference_and_a_rows_bits_do_not_depend_on_the_batch(dtype, mxfp8_qmv_on):
    """Normal x at the stacked q_a+kv width of V4 Flash: within the output's rounding of MLX's quantized
    matmul; and each row gets the same bits at every batch size (1, 4, 8 and 16 accumulators a weight row)."""
    from tessera.kernels.mxfp8_qmv import mxfp8_qmv_kernel, mxfp8_qmv_reference

    rng = np.random.default_rng(12)
    values, scales = _mxfp8_weight(rng, 1, 1536, 4096, _E4M3_FINITE, scale_spread=8)
    x = mx.array(rng.standard_normal((1, 16, 4096)).astype(np.float32)).astype(dtype)
    full = mxfp8_qmv_kernel(x, values, scales)
    got = np.array(full.astype(mx.float32))
    want = np.array(mxfp8_qmv_reference(x, values, scales).astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=2.0**-10 * float(np.abs(want).max()))
    for rows in (1, 2, 3, 7, 8, 13):
        assert _same_bits(mxfp8_qmv_kernel(x[:, :rows], values, scales), full[:, :rows]), rows


def test_projections_take_the_mxfp8_qmv_kernel_for_a_decode_batchs_rows(mxfp8_qmv_on, monkeypatch):
    """engine/model/quantized.py: `linear` and `grouped_linear` over 8..16 rows of a narrow mxfp8 weight run
    the kernel, within rounding of MLX's quantized matmul; fewer rows, a weight wide enough for MLX's GEMM
    and the switch off keep MLX's."""
    from tessera.engine.model import quantized
    from tessera.kernels import mxfp8_qmv

    w = quantized.quantize(mx.random.normal((1024, 4096), key=mx.random.key(1)).astype(mx.bfloat16) * 0.02, "mxfp8", 32)
    calls = []
    real = mxfp8_qmv.mxfp8_qmv_kernel
    monkeypatch.setattr(mxfp8_qmv, "mxfp8_qmv_kernel", lambda *a: calls.append(a[0].shape) or real(*a))
    x = mx.random.normal((16, 1, 4096), key=mx.random.key(2)).astype(mx.bfloat16)
    xg = mx.random.normal((8, 9, 4096), key=mx.random.key(3)).astype(mx.bfloat16)
    got = np.array(quantized.linear(x, w).astype(mx.float32))
    grouped = np.array(quantized.grouped_linear(xg, w, 8).astype(mx.float32))
    _ = quantized.linear(x[:7], w)
    wide = quantized.quantize(mx.random.normal((132 * 128, 1024), key=mx.random.key(4)).astype(mx.bfloat16), "mxfp8", 32)
    _ = quantized.linear(x[..., :1024], wide)
    assert calls == [(1, 16, 4096), (8, 9, 4096)]
    mxfp8_qmv.set_kernel_enabled(False)
    want = np.array(quantized.linear(x, w).astype(mx.float32))
    want_grouped = np.array(quantized.grouped_linear(xg, w, 8).astype(mx.float32))
    assert calls == [(1, 16, 4096), (8, 9, 4096)]
    assert got.shape == want.shape == (16, 1, 1024) and grouped.shape == want_grouped.shape == (8, 9, 128)
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=2**-6 * float(np.abs(want).max()))
    np.testing.assert_allclose(grouped, want_grouped, rtol=2**-6, atol=2**-6 * float(np.abs(want_grouped).max()))


# --- the MoE router after its product (kernels/moe_route.py) --------------------------------------------

_ROUTE_SCALING = 1.5  # V4's routed_scaling_factor: not 1, so a dropped scaling shows


@pytest.fixture
def moe_route_on():
    from tessera.kernels import moe_route

    yield from _kernel_switched_on(moe_route)


def _route_case(tokens: int, experts: int, k: int, seed: int, vocab: int = 1000):
    """Router logits [T, E] float32 at a trained router's spread, a small correction bias [E], a token -> k distinct
    experts table [vocab, k] uint32 (as the model holds it) and the tokens' ids [T] int32."""
    rng = np.random.default_rng(seed)
    logits = mx.array((rng.standard_normal((tokens, experts)) * 2).astype(np.float32))
    bias = mx.array((rng.standard_normal(experts) * 0.1).astype(np.float32))
    table = mx.array(np.stack([rng.permutation(experts)[:k] for _ in range(vocab)]).astype(np.uint32))
    ids = mx.array(rng.integers(0, vocab, tokens).astype(np.int32))
    return logits, bias, table, ids


def _route(hashed: bool, kernel: bool, logits, bias, table, ids, k: int):
    """-> (experts [T, k], weights [T, k]): the kernel's or the reference's, learned or hash routing."""
    from tessera.kernels import moe_route

    if hashed:
        fn = moe_route.hash_route_kernel if kernel else moe_route.hash_route_reference
        return fn(logits, table, ids, _ROUTE_SCALING)
    fn = moe_route.route_kernel if kernel else moe_route.route_reference
    return fn(logits, bias, k, _ROUTE_SCALING)


@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hash"])
@pytest.mark.parametrize("tokens", [1, 16, 64])
@pytest.mark.parametrize("experts, k", [(256, 6), (4, 2)], ids=["v4", "tiny"])
def test_route_kernel_picks_the_references_experts_and_weights(hashed, tokens, experts, k, moe_route_on):
    """Each token's experts are the reference's (as a set; a hash layer's in the table's order), and each expert's
    weight is the reference's within a few float32 ulps (MLX sums the k weights in its own order)."""
    case = _route_case(tokens, experts, k, seed=tokens + experts)
    got_e, got_w = _route(hashed, True, *case, k)
    want_e, want_w = _route(hashed, False, *case, k)
    assert got_e.dtype == mx.uint32 and got_w.dtype == mx.float32 and got_e.shape == got_w.shape == (tokens, k)
    got_e, got_w, want_e, want_w = (np.array(a) for a in (got_e, got_w, want_e, want_w))
    if hashed:
        assert np.array_equal(got_e, want_e)
    for t in range(tokens):
        assert set(got_e[t].tolist()) == set(want_e[t].tolist()), t
        by_got, by_want = np.argsort(got_e[t]), np.argsort(want_e[t])
        np.testing.assert_allclose(got_w[t][by_got], want_w[t][by_want], rtol=2e-6, atol=0, err_msg=str(t))


def test_route_kernel_fills_the_slots_in_descending_biased_order(moe_route_on):
    """A learned layer's slots: the chosen experts by descending score + bias (MLX's scores, the same to an ulp)."""
    from tessera.kernels import moe_route

    logits, bias, table, ids = _route_case(64, 256, 6, seed=3)
    experts, _ = moe_route.route_kernel(logits, bias, 6, _ROUTE_SCALING)
    biased = np.array(moe_route.scores(logits) + bias)  # [T, E]
    picked = np.take_along_axis(biased, np.array(experts).astype(np.int64), axis=1)  # [T, k]
    assert np.all(picked[:, :-1] >= picked[:, 1:])
    assert np.all(picked[:, -1] >= np.sort(biased, axis=1)[:, -6])  # none left out ranks above a chosen one


def test_route_kernel_breaks_exact_ties_to_the_lower_expert(moe_route_on):
    """Rows of equal logits and a bias of three values: the biased scores tie exactly within each value, so the
    chosen experts are the stable descending order's first k (ties to the lower index), and their weights one value."""
    from tessera.kernels import moe_route

    rng = np.random.default_rng(4)
    tokens, experts, k = 16, 256, 6
    logits = mx.array(np.repeat(rng.uniform(-1, 1, (tokens, 1)), experts, axis=1).astype(np.float32))
    bias_np = rng.choice(np.array([0.0, 0.25, 0.5], dtype=np.float32), experts)
    got_e, got_w = moe_route.route_kernel(logits, mx.array(bias_np), k, _ROUTE_SCALING)
    want = np.argsort(-bias_np, kind="stable")[:k]
    assert np.array_equal(np.array(got_e), np.tile(want, (tokens, 1)))
    got_w = np.array(got_w)
    assert np.all(got_w == got_w[:, :1])


@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hash"])
def test_route_kernel_gives_a_token_the_same_bits_alone_and_in_a_batch(hashed, moe_route_on):
    """A token's ranks and sums read its own row only: its experts and weights' bits at batch 1 and in a batch of 16."""
    logits, bias, table, ids = _route_case(16, 256, 6, seed=5)
    batch_e, batch_w = _route(hashed, True, logits, bias, table, ids, 6)
    for t in range(16):
        alone_e, alone_w = _route(hashed, True, logits[t : t + 1], bias, table, ids[t : t + 1], 6)
        assert mx.array_equal(alone_e, batch_e[t : t + 1]).item() and _same_bits(alone_w, batch_w[t : t + 1]), t


@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hash"])
def test_the_engines_route_takes_the_kernel_in_a_decode_batch(hashed, moe_route_on):
    """engine/model/moe.py `route` on a decode batch (bf16 rows, as the model's) takes the kernel and picks the experts
    MLX's ops pick with the switch off, their weights within a few ulps."""
    import dataclasses

    from tessera.engine.model.moe import MoEWeights, route
    from tessera.kernels import moe_route

    rng = np.random.default_rng(6)
    n = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    w = MoEWeights(router=n(256, 512) * 0.1, correction_bias=n(256) * 0.1, tid2eid=None, w1=n(1), w2=n(1), w3=n(1),
                   shared_w1=n(1), shared_w2=n(1), shared_w3=n(1))
    if hashed:
        w = dataclasses.replace(w, correction_bias=None, tid2eid=_route_case(1, 256, 6, seed=7)[2])
    x = n(8, 512).astype(mx.bfloat16)
    ids = mx.arange(8, dtype=mx.int32)
    assert moe_route.is_supported(moe_route.router_logits(x, w.router_t), 6)
    got_e, got_w = route(x, ids, w, 6, _ROUTE_SCALING)
    moe_route.set_kernel_enabled(False)
    want_e, want_w = route(x, ids, w, 6, _ROUTE_SCALING)
    got_e, got_w, want_e, want_w = (np.array(a) for a in (got_e, got_w, want_e, want_w))
    for t in range(8):
        by_got, by_want = np.argsort(got_e[t]), np.argsort(want_e[t])
        assert np.array_equal(got_e[t][by_got], want_e[t][by_want]), t
        np.testing.assert_allclose(got_w[t][by_got], want_w[t][by_want], rtol=2e-6, atol=0, err_msg=str(t))
