"""The CUDA kernels against their plain-MLX references, on the device they run on. Skipped where MLX has no
CUDA device (an allowed skip: tests/skip_allowlist.txt); on a CUDA machine `pytest tests/test_kernels_cuda.py`
is the pass/fail form of `tessera check kernels`, with the same thresholds (engine/tools/check_limits.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.kernels import device_checks, indexer_cuda, topk_cuda
from tessera.kernels.cuda import on_cuda
from tessera.kernels.indexer import indexer_scores_batched_reference, indexer_scores_reference, select_topk_reference

pytestmark = pytest.mark.skipif(not on_cuda(), reason="needs a CUDA device (MLX's CUDA build)")


def test_check_kernels_report_is_within_every_threshold():
    report = device_checks.check_indexer_kernel()
    assert report.get("kernel") != device_checks.UNAVAILABLE, report
    assert device_checks.kernel_failures(report) == [], report


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


@pytest.mark.parametrize("rows", [1, 37, 1000])
def test_sinkhorn_kernel_equals_the_ordered_reference(rows):
    """Round-to-nearest adds and divisions in the reference's order: the same bits, token by token."""
    from tessera.kernels.sinkhorn import sinkhorn_kernel, sinkhorn_ordered, sinkhorn_reference

    comb = mx.softmax(mx.random.normal((rows, 4, 4), key=mx.random.key(rows)) * 3, axis=-1) + 1e-6
    got = sinkhorn_kernel(comb, 20, 1e-6)
    assert mx.array_equal(got, sinkhorn_ordered(comb, 20, 1e-6)).item()
    assert mx.allclose(got, sinkhorn_reference(comb, 20, 1e-6), rtol=1e-5, atol=1e-7).item()
    assert mx.array_equal(sinkhorn_kernel(comb[:1], 20, 1e-6), got[:1]).item()  # a row alone: the same bits


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


@pytest.mark.parametrize("num_seqs, width", [(1, 512), (16, 512), (19, 64)])
def test_batched_row_gather_kernel_is_each_buffers_gather(num_seqs, width):
    """Decode's selected rows: one launch (per 16 sequences) over every sequence's own buffer gives
    exactly MLX's per-buffer x[idx] (a copy), whatever the buffers' capacities."""
    from tessera.kernels.row_gather import batch_is_supported, take_rows_batched_kernel, take_rows_batched_reference

    xs = [mx.random.normal((300 + 7 * b, width), key=mx.random.key(b)).astype(mx.bfloat16) for b in range(num_seqs)]
    idx = mx.sort(mx.random.randint(0, 300, (num_seqs, 512), key=mx.random.key(99)), axis=-1).astype(mx.int32)
    assert batch_is_supported(xs, idx)
    assert mx.array_equal(take_rows_batched_kernel(xs, idx), take_rows_batched_reference(xs, idx)).item()
