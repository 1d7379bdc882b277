"""Every kernel's plain-MLX reference against an independent formula. The CUDA kernels themselves run only on a
CUDA device: tests/test_kernels_cuda.py (and `tessera check kernels`) compare them with these references there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.cache import RowBuffer
from tessera.kernels import indexer, indexer_cuda
from tessera.kernels.indexer import indexer_scores_reference, mask_invisible, select_topk_reference, select_topk_threshold
from tessera.kernels.sparse_attention import mixed_attention_reference, shared_rows
from tests.equivalence.row_invariant_blas import row_invariant_blas
from tests.support.graph_nodes import primitive_kinds


def _valid_rows(selection):
    rows, valid = (np.array(a) for a in selection)
    return [tuple(r[v]) for r, v in zip(rows, valid)]


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_threshold_topk_keeps_the_reference_rows(ties):
    rng = np.random.default_rng(1 + ties)
    for _ in range(40):
        t, n, k = (int(x) for x in (rng.integers(1, 33), rng.integers(1, 400), rng.integers(1, 64)))
        raw = rng.integers(-3, 4, (t, n)) if ties else rng.standard_normal((t, n))
        visible = mx.array(rng.integers(0, n + 1, t))
        scores = mask_invisible(mx.array(raw.astype(np.float32)), visible)
        assert _valid_rows(select_topk_threshold(scores, visible, k)) == _valid_rows(select_topk_reference(scores, visible, k))


def test_ties_go_to_the_lower_row_index():
    scores = mx.array([[1.0, 2.0, 2.0, 0.0, 2.0]])
    rows, valid = select_topk_reference(scores, mx.array([5]), 2)
    assert rows.tolist() == [[1, 2]] and valid.tolist() == [[True, True]]


def test_indexer_reference_equals_per_head_formula():
    rng = np.random.default_rng(0)
    q, w, k = rng.standard_normal((6, 4, 16)), rng.standard_normal((6, 4)), rng.standard_normal((50, 16))
    visible = np.array([0, 1, 10, 49, 50, 50])
    expected = np.einsum("th,ths->ts", w, np.maximum(np.einsum("thd,sd->ths", q, k), 0)) * 0.25
    expected[np.arange(50)[None, :] >= visible[:, None]] = -np.inf
    got = indexer_scores_reference(*(mx.array(a.astype(np.float32)) for a in (q, w, k)), mx.array(visible), 0.25)
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_q,num_keys", [(1, 1), (1, 333), (1, 4096), (5, 200)])
@row_invariant_blas
def test_indexer_all_heads_at_once_is_bit_identical_to_the_head_loop(monkeypatch, num_q, num_keys):
    """Decode scores every head in one gemm; prefill tiles loop over heads: a query row must get
    the same bits either way, or decode would select different rows than a prefill of the same
    position."""
    rng = np.random.default_rng(num_keys)
    q, w = rng.standard_normal((num_q, 16, 64)), rng.standard_normal((num_q, 16))
    k, visible = rng.standard_normal((num_keys, 64)), rng.integers(0, num_keys + 1, num_q)
    args = [mx.array(a.astype(np.float32)) for a in (q, w, k)] + [mx.array(visible)]
    at_once = np.array(indexer_scores_reference(*args, 0.3))
    monkeypatch.setattr(indexer, "LAZY_SCRATCH_ELEMENTS", 0)  # every size takes the head loop
    looped = np.array(indexer_scores_reference(*args, 0.3))
    assert np.array_equal(at_once, looped)


def _buffers(keys: list[mx.array], spare: int = 100) -> list[RowBuffer]:
    """The keys as cache buffers with spare capacity (rows past num_rows must never be read)."""
    return [RowBuffer.holding(k, k.shape[0] + spare) for k in keys]


@pytest.mark.parametrize("num_keys", [1, 333, 4096])
@row_invariant_blas
def test_batched_decode_scores_equal_each_sequence_scored_alone(monkeypatch, num_keys):
    """A decode batch scores B sequences, each against its own keys, in one product: every row must be
    the bits `indexer_scores_reference` gives that sequence alone (head loop or all heads at once), or a
    batched sequence would select other rows than the same sequence decoded alone."""
    rng = np.random.default_rng(num_keys)
    num_seqs = 5
    q, w = rng.standard_normal((num_seqs, 16, 64)), rng.standard_normal((num_seqs, 16))
    keys = [mx.array(rng.standard_normal((num_keys, 64)).astype(np.float32)) for _ in range(num_seqs)]
    visible = mx.array(rng.integers(0, num_keys + 1, num_seqs))
    q, w = mx.array(q.astype(np.float32)), mx.array(w.astype(np.float32))
    alone = [np.array(indexer_scores_reference(q[b : b + 1], w[b : b + 1], keys[b], visible[b : b + 1], 0.3))
             for b in range(num_seqs)]
    batched = np.array(indexer.indexer_scores_batched_reference(q, w, mx.stack(keys), visible, 0.3))
    assert batched.shape == (num_seqs, num_keys)
    for b in range(num_seqs):
        assert np.array_equal(batched[b : b + 1], alone[b]), b
    dispatched = np.array(indexer.indexer_scores_batched(q, w, _buffers(keys), visible, 0.3))
    monkeypatch.setattr(indexer, "BATCHED_SCRATCH_ELEMENTS", 0)  # one sequence at a time
    per_sequence = np.array(indexer.indexer_scores_batched(q, w, _buffers(keys), visible, 0.3))
    assert np.array_equal(dispatched, batched) and np.array_equal(per_sequence, batched)


@row_invariant_blas
def test_batched_scores_of_different_key_counts_are_each_sequence_alone_then_masked():
    """Sequences with different N in one batch: row b's first N_b scores are that sequence alone, the
    rest -inf, so the top-k picks the rows single-sequence decode picks (none of them past N_b)."""
    rng = np.random.default_rng(7)
    counts = [40, 3, 0, 40, 17]
    q = mx.array(rng.standard_normal((5, 16, 64)).astype(np.float32))
    w = mx.array(rng.standard_normal((5, 16)).astype(np.float32))
    keys = [mx.array(rng.standard_normal((n, 64)).astype(np.float32)) for n in counts]
    visible = mx.array(counts)
    got = indexer.indexer_scores_batched(q, w, _buffers(keys), visible, 0.3)
    assert got.shape == (5, 40)
    for b, n in enumerate(counts):
        alone = indexer_scores_reference(q[b : b + 1], w[b : b + 1], keys[b], visible[b : b + 1], 0.3)
        assert np.array_equal(np.array(got[b : b + 1, :n]), np.array(alone)), b
        assert np.all(np.isneginf(np.array(got[b, n:]))), b
        rows, valid = select_topk_reference(got[b : b + 1], visible[b : b + 1], 8)
        want_rows, want_valid = select_topk_reference(alone, visible[b : b + 1], 8)
        assert _valid_rows((rows, valid)) == _valid_rows((want_rows, want_valid)), b


def test_batched_scores_reach_the_batched_kernel_with_the_buffers_where_they_lie(monkeypatch):
    """Where the CUDA kernel runs, a decode batch is one call of the batched kernel, given every
    sequence's whole buffer (no slice, no stack) and its key count. The kernel is stood in for by the
    reference here (tests/test_kernels_cuda.py compares the real one with the single kernel)."""
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((3, 16, 64)).astype(np.float32))
    w = mx.array(rng.standard_normal((3, 16)).astype(np.float32))
    keys = [mx.array(rng.standard_normal((40, 64)).astype(np.float32)) for _ in range(3)]
    buffers, visible = _buffers(keys), mx.array([40, 7, 0])
    calls = []

    def kernel(q, w, data, num_keys, visible, scale):
        calls.append((data, num_keys))
        return indexer.indexer_scores_batched_reference(q, w, mx.stack([d[:n] for d, n in zip(data, num_keys)]), visible, scale)

    monkeypatch.setattr(indexer_cuda, "batch_is_supported", lambda q: True)
    monkeypatch.setattr(indexer_cuda, "indexer_scores_batched_kernel", kernel)
    got = np.array(indexer.indexer_scores_batched(q, w, buffers, visible, 0.3))
    assert len(calls) == 1 and calls[0][1] == [40, 40, 40]
    assert all(d is b.data() and d.shape[0] > 40 for d, b in zip(calls[0][0], buffers))
    assert np.array_equal(got, np.array(indexer.indexer_scores_batched_reference(q, w, mx.stack(keys), visible, 0.3)))


@pytest.mark.parametrize("num_seqs", [1, 5])
def test_selected_rows_are_the_same_bits_through_each_gather_path(monkeypatch, num_seqs):
    """Decode attention's selected rows: the batched CUDA gather (stood in by its reference, given every
    buffer whole), the stacked gather and the per-sequence gathers copy the same rows."""
    from tessera.engine.model import decode_attention
    from tessera.kernels import row_gather

    rng = np.random.default_rng(num_seqs)
    buffers = _buffers([mx.array(rng.standard_normal((50, 32)).astype(np.float32)) for _ in range(num_seqs)])
    selected = mx.array(np.sort(rng.integers(0, 50, (num_seqs, 12)), axis=-1).astype(np.int32))
    want = np.stack([np.array(b.view())[np.array(s)] for b, s in zip(buffers, selected)])
    got = {}
    for path, stacked_bytes in (("stacked", 2**40), ("per_sequence", 0)):
        monkeypatch.setattr(decode_attention, "STACKED_GATHER_BYTES", stacked_bytes)
        got[path] = np.array(decode_attention._gather_selected(buffers, selected))
    calls = []
    monkeypatch.setattr(row_gather, "batch_is_supported", lambda xs, idx: True)
    monkeypatch.setattr(row_gather, "take_rows_batched_kernel",
                        lambda xs, idx: calls.append(xs) or row_gather.take_rows_batched_reference(xs, idx))
    got["kernel"] = np.array(decode_attention._gather_selected(buffers, selected))
    assert len(calls) == 1 and all(x is b.data() for x, b in zip(calls[0], buffers))
    for path, rows in got.items():
        assert np.array_equal(rows, want), path


def test_decode_batch_kernels_switch_turns_both_batched_kernels_off(monkeypatch):
    """TESSERA_DECODE_BATCH_KERNELS=0 (kernels/cuda.py) leaves the decode batch on the per-sequence path."""
    from tessera.kernels import cuda, row_gather

    monkeypatch.setattr(indexer_cuda, "on_cuda", lambda: True)
    monkeypatch.setattr(row_gather, "on_cuda", lambda: True)
    q, xs, idx = mx.zeros((2, 16, 64)), [mx.zeros((8, 32))] * 2, mx.zeros((2, 4), dtype=mx.int32)
    monkeypatch.setattr(cuda.decode_batch_kernels, "_enabled", True)
    monkeypatch.setattr(row_gather._batch_switch, "_enabled", False)
    assert indexer_cuda.batch_is_supported(q) and not row_gather.batch_is_supported(xs, idx)  # the gather's own switch
    monkeypatch.setattr(row_gather._batch_switch, "_enabled", True)
    assert row_gather.batch_is_supported(xs, idx)
    monkeypatch.setattr(cuda.decode_batch_kernels, "_enabled", False)
    assert not indexer_cuda.batch_is_supported(q) and not row_gather.batch_is_supported(xs, idx)
    assert indexer_cuda.is_supported(q)  # the single kernel still runs, once per sequence


def test_hca_decode_rows_take_one_batched_gather_launch_with_the_concatenations_rows(monkeypatch):
    """engine/model/decode_attention.py: an HCA decode batch's every compressed row, with the batched row
    gather on (CUDA faked here, the launch computed by the reference), is one launch over each sequence's
    buffer where it lies (indices 0 … N-1 per sequence, spare capacity never read) and gives the rows the
    concatenation of the buffers' views gives; off, the concatenation runs."""
    from types import SimpleNamespace

    from tessera.engine.model import decode_attention
    from tessera.engine.model.cache import RowBuffer
    from tessera.kernels import cuda, row_gather

    launches = []

    def fake(name, input_names, outputs, source, header):
        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            idx, xs = inputs[0], inputs[1 : 1 + grid[2]]
            launches.append((np.array(idx).tolist(), [x.shape[0] for x in xs], len(inputs) - 1))
            return [row_gather.take_rows_batched_reference(list(xs), idx)]
        return launch

    buffers = []
    for b in range(3):
        buf = RowBuffer(32, mx.float32)
        buf.append(mx.random.normal((5, 32), key=mx.random.key(b)))
        buffers.append(buf)
    segs = [SimpleNamespace(cache=SimpleNamespace(compressed=buf)) for buf in buffers]
    visible = mx.array([5, 3, 5])
    want_rows, want_valid = decode_attention._all_compressed_rows(segs, visible)  # the concatenation (CPU)
    assert launches == []
    monkeypatch.setattr(row_gather, "on_cuda", lambda: True)
    monkeypatch.setattr(row_gather, "compiled_kernel", fake)
    monkeypatch.setattr(cuda.decode_batch_kernels, "_enabled", True)
    monkeypatch.setattr(row_gather._batch_switch, "_enabled", True)
    rows, valid = decode_attention._all_compressed_rows(segs, visible)
    assert launches == [([list(range(5))] * 3, [256] * 3, 4)]  # whole buffers (capacity 256), in 4 input slots
    assert rows.shape == (3, 5, 32) and mx.array_equal(rows, want_rows).item()
    assert mx.array_equal(valid, want_valid).item() and np.array(valid).sum(axis=1).tolist() == [5, 3, 5]


def test_batched_kernels_launch_with_power_of_two_inputs_and_one_block_row_per_sequence(monkeypatch):
    """The Python side of the batched CUDA launches, with the kernel faked: 19 sequences run as 16 + 3,
    the 3 in a 4-slot kernel (the spare slot repeats the last buffer), grid z = the sequences, and
    `sizes` is each N, zeros for spare slots, then the output width."""
    from tessera.kernels import row_gather

    launches = []

    def fake(name, input_names, outputs, source, header):
        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launches.append((name, len(inputs) - len(input_names), inputs, dict(template), grid, output_shapes))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return launch

    monkeypatch.setattr(indexer_cuda, "compiled_kernel", fake)
    monkeypatch.setattr(row_gather, "compiled_kernel", fake)
    counts = [300 + b for b in range(19)]
    keys = [mx.zeros((n + 5, 64), dtype=mx.bfloat16) for n in counts]
    q, w = mx.zeros((19, 16, 64), dtype=mx.bfloat16), mx.zeros((19, 16))
    scores = indexer_cuda.indexer_scores_batched_kernel(q, w, keys, counts, mx.array(counts), 1.0)
    assert scores.shape == (19, 318)
    (n16, extra16, in16, t16, g16, o16), (n4, extra4, in4, t4, g4, o4) = launches
    assert (n16, t16["NB"], g16[2], o16) == ("tessera_indexer_scores_batched_16", 16, 16, [(16, 318)])
    assert (n4, t4["NB"], g4[2], o4) == ("tessera_indexer_scores_batched_4", 4, 3, [(3, 318)])
    assert extra16 == extra4 == 0 and len(in4) == 4 + 4 and in4[-1] is in4[-2]
    assert in4[3].tolist() == [316, 317, 318, 0, 318] and in16[3].tolist() == counts[:16] + [318]
    launches.clear()
    idx = mx.zeros((19, 7), dtype=mx.int32)
    rows = row_gather.take_rows_batched_kernel(keys, idx)
    assert rows.shape == (19, 7, 64)
    assert [(n, len(i), g[2]) for n, _, i, _, g, _ in launches] == [
        ("tessera_take_rows_batched_16", 17, 16), ("tessera_take_rows_batched_4", 5, 3)]


@pytest.mark.parametrize("counts", [[1], [300, 1, 4099, 256, 257], [512] * 3])
def test_batched_indexer_kernel_writes_every_score_exactly_once(counts):
    """The batched kernel's index arithmetic, emulated (kernels/indexer_cuda._BATCHED_PREAMBLE, then the
    single kernel's body with one query row): block (x, seq) fills -inf at [max(N, x0), min(width, x0 + 256))
    and, unless x0 ≥ N, its 8 warps' scores at [x0, x0 + 256) below N. Every [seq, s < width] once."""
    width = max(counts)
    (grid_x, _, _), (threads, _, _) = indexer_cuda.launch_shape(1, width)
    written = np.zeros((len(counts), width), dtype=int)
    for seq, n in enumerate(counts):
        for bx in range(grid_x // threads):
            x0 = bx * indexer_cuda.KEYS_PER_BLOCK
            for s in range(max(n, x0), min(width, x0 + indexer_cuda.KEYS_PER_BLOCK)):
                written[seq, s] += 1  # -inf
            if x0 >= n:
                continue
            for warp in range(indexer_cuda.WARPS):
                for n8, tig, e in np.ndindex(4, 4, 2):  # lanes of group 0 hold query row 0
                    col = x0 + warp * indexer_cuda.KEYS_PER_WARP + n8 * 8 + tig * 2 + e
                    if col < n:
                        written[seq, col] += 1
    assert (written == 1).all()


def test_mixed_attention_equals_dense_softmax_with_sink():
    rng = np.random.default_rng(3)
    t, h, d, r, s = 5, 3, 8, 7, 4
    q, rows, shared = rng.standard_normal((t, h, d)), rng.standard_normal((t, r, d)), rng.standard_normal((s, d))
    valid, shared_valid, sinks = rng.random((t, r)) > 0.3, rng.random((t, s)) > 0.5, rng.standard_normal(h)
    keys = np.concatenate([rows, np.broadcast_to(shared, (t, s, d))], axis=1)  # [t, r + s, d]
    mask = np.concatenate([valid, shared_valid], axis=1)
    logits = np.einsum("thd,tjd->thj", q, keys) * 0.5
    logits = np.where(mask[:, None, :], logits, -np.inf)
    full = np.concatenate([logits, np.broadcast_to(sinks[None, :, None], (t, h, 1))], axis=-1)
    probs = np.exp(full - full.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.einsum("thj,tjd->thd", probs[..., :-1], keys)
    f32 = lambda a: mx.array(np.asarray(a, dtype=np.float32))  # noqa: E731
    groups = [(f32(rows), mx.array(valid)), (shared_rows(f32(shared), t), mx.array(shared_valid))]
    got = mixed_attention_reference(f32(q), groups, f32(sinks), 0.5)
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_a_group_without_rows_adds_nothing_and_runs_no_product(tmp_path, shared):
    """An HCA or CSA layer before its first compressed row (a context shorter than the ratio) passes a
    group of zero rows: the output is the other groups' bits, and the graph holds no product over the
    empty axis (MLX 0.32.4's CUDA matmul segfaults on one: a short prompt crashed the H200)."""
    rng = np.random.default_rng(5)
    f32 = lambda a: mx.array(np.asarray(a, dtype=np.float32))  # noqa: E731
    t, h, d = 4, 2, 8
    q, window, sinks = f32(rng.standard_normal((t, h, d))), f32(rng.standard_normal((t, 6, d))), f32(rng.standard_normal(h))
    window_group = (window, mx.array(rng.random((t, 6)) > 0.3))
    empty = (shared_rows(mx.zeros((0, d)), t) if shared else mx.zeros((t, 0, d)), mx.zeros((t, 0), dtype=mx.bool_))
    mx.eval(q, window_group, sinks, empty)
    alone = mixed_attention_reference(q, [window_group], sinks, 0.5)
    with_empty = mixed_attention_reference(q, [window_group, empty], sinks, 0.5)

    def products(out: mx.array) -> int:  # matmul nodes in the graph (before it is evaluated)
        return primitive_kinds(out, tmp_path / "graph.dot")["Matmul"]

    assert products(with_empty) == products(alone) == 2
    assert np.array_equal(np.array(with_empty).view(np.uint32), np.array(alone).view(np.uint32))
    # with nothing but the sink, every probability is the sink's: zeros
    assert not np.any(np.array(mixed_attention_reference(q, [empty], sinks, 0.5)))


def test_cuda_kernel_is_only_dispatched_on_cuda():
    q = mx.zeros((2, 4, 128), dtype=mx.bfloat16)
    assert indexer_cuda.is_supported(q) == (mx.default_device() == mx.gpu and mx.cuda.is_available())


@pytest.mark.parametrize("rows", [1, 9, 130])
def test_sinkhorn_ordered_reference_is_the_reference_bit_for_bit(rows):
    """The order the CUDA Sinkhorn kernel sums in (kernels/sinkhorn.py) is the CPU reduction's order."""
    from tessera.kernels.sinkhorn import sinkhorn_ordered, sinkhorn_reference

    comb = mx.softmax(mx.random.normal((rows, 4, 4), key=mx.random.key(rows)) * 3, axis=-1) + 1e-6
    got, want = sinkhorn_ordered(comb, 20, 1e-6), sinkhorn_reference(comb, 20, 1e-6)
    assert mx.array_equal(got, want).item()
    assert mx.allclose(want.sum(axis=-2), mx.ones((rows, 4)), atol=1e-4).item()


@pytest.mark.parametrize("eps", [1e-6, 1e-12, 0.1])
def test_sinkhorn_kernel_constants_carry_the_exact_float32_eps(eps):
    """The CUDA Sinkhorn kernel takes eps and iters as compile-time constants (no per-call arrays):
    eps as its float32 bits, which must decode to the float32 the reference adds."""
    from tessera.kernels.sinkhorn import kernel_template

    constants = dict(kernel_template(4, 20, eps))
    assert constants["HC"] == 4 and constants["ITERS"] == 20
    decoded = np.array([constants["EPS_BITS"]], dtype=np.int32).view(np.float32)[0]
    assert decoded == np.float32(eps)
    assert mx.array([eps], dtype=mx.float32).item() == float(decoded)


@pytest.mark.parametrize("hc, rows", [(4, 1), (4, 3), (4, 16), (3, 7), (2, 9)])
def test_sinkhorn_warp_layout_lanes_add_and_divide_as_the_ordered_reference(hc, rows):
    """kernels/sinkhorn.py's warp layout, its lane arithmetic written out in NumPy float32 (IEEE adds and
    divisions, as __fadd_rn and __fdiv_rn): lane -> (token slot, i, j), the eps added to its softmax entry, row
    and column sums read from the lanes the kernel shuffles from, idle lanes included, the entry written
    transposed. It must give mixing_ordered's bits (float32 out); the CUDA test runs the kernel itself
    (tests/test_kernels_cuda.py)."""
    from tessera.kernels.sinkhorn import mixing_ordered, tokens_per_warp

    probs = mx.softmax(mx.random.normal((rows, hc, hc), key=mx.random.key(rows)) * 3, axis=-1)
    flat, eps, group, per_warp = np.array(probs).reshape(rows, hc * hc), np.float32(1e-6), hc * hc, tokens_per_warp(hc)
    out = np.zeros_like(flat)
    for warp in range(-(-rows // per_warp)):
        lane = np.arange(32)
        slot, i, j = lane // group, (lane % group) // hc, (lane % group) % hc
        t = warp * per_warp + slot
        active = (slot < per_warp) & (t < rows)
        base = np.where(slot < per_warp, slot, 0) * group
        v = np.where(active, flat[np.minimum(t, rows - 1), i * hc + j] + eps, np.float32(1.0)).astype(np.float32)
        shfl = lambda src: v[src % 32]  # noqa: E731  (__shfl_sync: the value lane src holds)
        for it in range(20):
            if it > 0:
                s = shfl(base + i * hc)
                for k in range(1, hc):
                    s = s + shfl(base + i * hc + k)
                v = v / (s + eps)
            s = shfl(base + j)
            for k in range(1, hc):
                s = s + shfl(base + k * hc + j)
            v = v / (s + eps)
        out[t[active], (j * hc + i)[active]] = v[active]  # transposed
    want = np.array(mixing_ordered(probs, 20, 1e-6, mx.float32)).reshape(rows, hc * hc)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_mixing_matrix_is_the_sinkhorn_projection_rounded_and_transposed(dtype):
    """mixing_reference (what expand reads): the Sinkhorn projection of softmax + eps, in the streams' dtype,
    transposed; mixing_ordered (the kernel's bits) the same on the CPU."""
    from tessera.kernels.sinkhorn import mixing_ordered, mixing_reference, sinkhorn_reference

    probs = mx.softmax(mx.random.normal((5, 4, 4), key=mx.random.key(3)) * 3, axis=-1)
    comb = sinkhorn_reference(probs + 1e-6, 20, 1e-6)
    got = mixing_reference(probs, 20, 1e-6, dtype)
    assert got.dtype == dtype and mx.array_equal(got, comb.astype(dtype).transpose(0, 2, 1)).item()
    assert mx.array_equal(mixing_ordered(probs, 20, 1e-6, dtype), got).item()


def test_sinkhorn_warp_layout_is_the_default_and_switches_off():
    """TESSERA_SINKHORN_WARP (kernels/sinkhorn.py): a lane per matrix entry unless set to 0."""
    from tessera.kernels.sinkhorn import tokens_per_warp
    from tests.support.env_switch import switch_in_fresh_process

    assert switch_in_fresh_process("TESSERA_SINKHORN_WARP", None, "tessera.kernels.sinkhorn", "warp_enabled") == "True"
    assert switch_in_fresh_process("TESSERA_SINKHORN_WARP", "0", "tessera.kernels.sinkhorn", "warp_enabled") == "False"
    assert [tokens_per_warp(hc) for hc in (2, 3, 4, 5, 6)] == [8, 3, 2, 1, 0]


def test_every_cuda_kernel_source_compiles_for_the_h200():
    """Each kernel in kernels/ wrapped as MLX wraps a custom kernel and compiled by NVRTC for sm_90
    (docs/bench/nvrtc_compile_check.py; NVRTC from the test extra): a source edited without a GPU fails here,
    not at a lease's first decode step."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "docs/bench/nvrtc_compile_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 43 and all(line.endswith(": ok") for line in lines), done.stdout


def test_take_rows_is_the_row_gather_and_stays_on_mlx_off_cuda():
    """The MoE's row gathers (kernels/row_gather.py): row idx[i] at row i, repeats and any order; off
    CUDA (or for rows that are not whole 16-byte vectors) the reference runs."""
    from tessera.kernels import row_gather

    x = mx.arange(7 * 16, dtype=mx.float32).reshape(7, 16)
    idx = mx.array([6, 0, 0, 3, 6, 1], dtype=mx.uint32)
    got = row_gather.take_rows(x, idx)
    assert got.shape == (6, 16)
    assert np.array_equal(np.array(got), np.array(x)[[6, 0, 0, 3, 6, 1]])
    assert row_gather.take_rows(x, mx.array([], dtype=mx.int32)).shape == (0, 16)
    assert not row_gather.is_supported(x, idx)  # CPU
    odd = mx.zeros((4, 3), dtype=mx.bfloat16)  # 6-byte rows: never the kernel
    assert not row_gather.is_supported(odd, idx)


def test_mxfp8_qmv_decodes_e4m3_as_mlx_dequantizes_it():
    """kernels/mxfp8_qmv.py's premise: an E4M3 code c laid into fp16 bits as (c & 0x7F) << 7 | (c & 0x80) << 8
    is the code's value times 2^-8 exactly (normal and subnormal alike), checked here against MLX's own
    mxfp8 dequantize for every finite code; and V4 Flash's mxfp8 projection widths take the kernel."""
    from tessera.kernels import mxfp8_qmv

    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)  # 0x7F, 0xFF: NaN
    padded = np.zeros(256, dtype=np.uint8)
    padded[: codes.size] = codes
    values = mx.array(padded.view(np.uint32).reshape(1, 64))
    mlx_values = np.array(mx.dequantize(values, mx.full((1, 8), 127, dtype=mx.uint8), None, group_size=32, bits=8,
                                        mode="mxfp8").astype(mx.float32))[0, : codes.size]
    half_bits = ((codes.astype(np.uint16) & 0x7F) << 7) | ((codes.astype(np.uint16) & 0x80) << 8)
    assert np.array_equal(half_bits.view(np.float16).astype(np.float32) * 256.0, mlx_values)
    # q_a+kv, q_b, wo_a (per group), wo_b, shared w1/w3, shared w2, index wq_b: [out, in]
    for out_features, in_features in [(1536, 4096), (32768, 1024), (1024, 4096), (4096, 8192), (2048, 4096),
                                      (4096, 2048), (8192, 1024)]:
        assert mxfp8_qmv.fits(in_features, out_features)
    assert not mxfp8_qmv.fits(4096 + 128, 1536) and not mxfp8_qmv.fits(4096, 1537)
    # MLX's GEMM fills the H200's SMs at q_b (256 thread blocks), not at the others; wo_a: 8 groups of 1024
    assert mxfp8_qmv.gemm_blocks(1, 32768) == 256 and mxfp8_qmv.gemm_blocks(8, 1024) == 64
    assert mxfp8_qmv.gemm_blocks(1, 1536) == 12 and mxfp8_qmv.gemm_blocks(1, 1537) == 13
    assert [mxfp8_qmv.row_bucket(r) for r in (1, 2, 4, 5, 8, 9, 16)] == [1, 4, 4, 8, 8, 16, 16]


@pytest.mark.parametrize("module, function, env_var, default", [
    ("tessera.kernels.moe_padded", "combine_kernel_enabled", "TESSERA_MOE_COMBINE_KERNEL", "True"),
    ("tessera.kernels.moe_padded", "index_kernel_enabled", "TESSERA_MOE_INDEX_KERNEL", "True"),
    ("tessera.kernels.row_gather", "batch_gather_enabled", "TESSERA_DECODE_BATCH_GATHER", "True"),
    ("tessera.kernels.mxfp8_qmv", "kernel_enabled", "TESSERA_MXFP8_QMV_KERNEL", "True"),
])
def test_kernel_switch_defaults_are_what_the_h200_measured(module, function, env_var, default):
    """On where the kernel passed its CUDA tests and paid on the H200: the MoE's combine and index kernels
    (docs/BENCHMARKS.md, "Session 8 on the H200"), the batched decode gather ("Session 16"), the mxfp8 decode
    projections ("Session 15"). Each variable flips its default."""
    from tests.support.env_switch import switch_in_fresh_process

    assert switch_in_fresh_process(env_var, None, module, function) == default
    flipped = "0" if default == "True" else "1"
    assert switch_in_fresh_process(env_var, flipped, module, function) == str(default != "True")


def _host_compiled_mma_decode(tmp_path) -> tuple[np.ndarray, np.ndarray]:
    """kernels/gather_qmv.py's own `tessera_e2m1_pair` and `tessera_bf16x2_pow2` (device functions of plain integer
    arithmetic) compiled for this CPU with the host's C++ compiler: [2 words, 4 pairs] uint32 for two words holding
    codes 0 ... 15 (low nibble first), and [256] uint32 for exponent fields 0 ... 255."""
    import shutil
    import subprocess

    from tessera.kernels import gather_qmv

    header = gather_qmv._MMA_HEADER
    start = header.index("template <int I>")
    end = header.index("// a * b in each half")  # the pair decode and the power of two, not the PTX after them
    program = tmp_path / "decode.cpp"
    program.write_text("#include <cstdint>\n#include <cstdio>\n#include <algorithm>\nusing std::min; using std::max;\n"
                       "#define __device__\n#define __forceinline__ inline\n" + header[start:end] + """
int main() {
  const uint32_t words[2] = {0x76543210u, 0xFEDCBA98u};
  for (uint32_t w : words)
    std::printf("%u %u %u %u\\n", tessera_e2m1_pair<0>(w), tessera_e2m1_pair<1>(w), tessera_e2m1_pair<2>(w),
                tessera_e2m1_pair<3>(w));
  for (int field = 0; field < 256; ++field) std::printf("%u\\n", tessera_bf16x2_pow2(field));
}
""")
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "a C++ compiler (g++; .ci/run installs it) checks the CUDA source's decode on the CPU"
    subprocess.run([compiler, "-std=c++17", "-O1", "-o", str(tmp_path / "decode"), str(program)], check=True)
    lines = subprocess.run([str(tmp_path / "decode")], check=True, capture_output=True, text=True).stdout.split()
    numbers = np.array([int(v) for v in lines], dtype=np.uint32)
    return numbers[:8].reshape(2, 4), numbers[8:]


def _bf16_halves(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A bf16 pair's low and high halves as float64."""
    def as_float(bits):
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return as_float(pairs & 0xFFFF), as_float(pairs >> 16)


def test_the_mma_variants_code_decode_is_mlxs_mxfp4_dequantize(tmp_path):
    """The tensor-core variant's own decode, compiled for the CPU: pair I of a code word holds codes I and I + 4 as
    their values times 2^-126 (bf16 subnormals included), and the scale factor for field s + 126 times that is
    MLX's mxfp4 value under E8M0 scale s, for all sixteen codes (both zeros: their signs too) and the scales the
    one-multiply path takes (s <= 128; above, two factors, each of this form)."""
    pairs, pow2 = _host_compiled_mma_decode(tmp_path)
    low, high = _bf16_halves(pairs)  # [2 words, 4 pairs]: codes 8 w + I and 8 w + I + 4
    decoded = np.empty(16)
    decoded[np.add.outer(8 * np.arange(2), np.arange(4))] = low
    decoded[np.add.outer(8 * np.arange(2), np.arange(4) + 4)] = high
    words = mx.array(np.array([[0x76543210, 0xFEDCBA98, 0, 0]], dtype=np.uint32))  # codes 0 ... 15, one group of 32
    for scale in (0, 1, 100, 127, 128):
        mlx_values = np.array(mx.dequantize(words, mx.full((1, 1), scale, dtype=mx.uint8), None, group_size=32,
                                            bits=4, mode="mxfp4").astype(mx.float32))[0, :16].astype(np.float64)
        factor, same = _bf16_halves(pow2[scale + 126 : scale + 127])
        assert factor[0] == same[0] == 2.0 ** (scale - 1)
        assert np.array_equal(decoded * factor[0], mlx_values), scale
    assert np.array_equal(np.signbit(decoded), np.signbit(mlx_values))  # code 8 is -0.0 in both (any scale)


def test_bf16_rows_take_the_tensor_core_variant_only_where_its_switch_is_on(monkeypatch):
    """gather_qmv_kernel hands bf16 rows to gather_qmv_mma_kernel when TESSERA_GATHER_QMV_MMA is on, and
    float32 rows never (the variant's B operand is bf16)."""
    from tessera.kernels import gather_qmv

    calls = []
    monkeypatch.setattr(gather_qmv, "gather_qmv_mma_kernel", lambda x, *a: calls.append(x.dtype) or "mma")
    monkeypatch.setattr(gather_qmv, "compiled_kernel", lambda *a: lambda **kw: ("table",))
    values, scales = mx.zeros((2, 32, 128), dtype=mx.uint32), mx.zeros((2, 32, 32), dtype=mx.uint8)
    experts = mx.zeros((3,), dtype=mx.uint32)
    saved = gather_qmv.mma_enabled()
    try:
        for dtype, on, want in [(mx.bfloat16, True, "mma"), (mx.bfloat16, False, "table"), (mx.float32, True, "table")]:
            gather_qmv.set_mma_enabled(on)
            assert gather_qmv.gather_qmv_kernel(mx.zeros((3, 1024), dtype=dtype), values, scales, experts) == want
    finally:
        gather_qmv.set_mma_enabled(saved)
    assert calls == [mx.bfloat16]


def test_gather_qmv_takes_v4_flash_widths_and_no_width_its_shared_memory_cannot_hold():
    """kernels/gather_qmv.py stages each pair's x row in shared memory (STAGE_X): a width whose staged row
    does not fit the static limit must fall back to gather_qmm (a kernel that does not compile would fail
    the step), and V4 Flash's expert widths (hidden 4096 in, moe 2048 in) must still take the kernel."""
    from tessera.kernels import gather_qmv

    assert gather_qmv.fits(4096, 2048) and gather_qmv.fits(2048, 4096)
    for k in range(1024, 32769, 1024):
        assert gather_qmv.fits(k, 2048) == (gather_qmv.shared_memory_bytes(k) <= gather_qmv.SHARED_MEMORY_LIMIT)
    assert not gather_qmv.fits(12288, 2048) and gather_qmv.fits(11264, 2048)
    # The staged row itself: K float32 values padded to 33 per group of 32.
    assert gather_qmv.shared_memory_bytes(4096) - gather_qmv.shared_memory_bytes(4096, stage_x=False) == 128 * 33 * 4 - 4
