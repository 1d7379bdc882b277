"""Issue 12 on the CPU: every offset the GPU path computes, and the fault class itself.

On the H200, tiled != untiled for chunks like 3001 because cuBLAS picks its algorithm (and so the
reduction order) from the whole batched problem: the same attention row came out differently in a
197-row tile than in the 3001-row untiled call. The CPU's per-batch gemm hides that, so here a
stand-in for mixed attention whose bits depend on the batch size and the row's position in it plays
the GPU's part; the engine must stay exact with it, and the code before the fix does not. The CUDA
kernels' index arithmetic (launch grid, fragment → (row, key) writes, top-k slots) is emulated in
numpy against the references, and `tessera check gpu` is run with and without an injected fault.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import attention
from tessera.engine.model.attention import ATTENTION_ROWS, PROJECTION_ROWS, attention_blocks, window_key_indices
from tessera.engine.tools import commands
from tessera.engine.tools.replay import random_tokens, run_sequence
from tessera.kernels import indexer_cuda, topk_cuda
from tessera.kernels.indexer import mask_invisible, select_topk_reference
from tessera.kernels.sparse_attention import mixed_attention_reference
from tests.equivalence.row_invariant_blas import row_invariant_blas
# CHUNK = 320: 2.5 attention blocks; CTX ends inside a compression block
from tests.support.rope_tables import padded_rope_tables
from tests.support.tiling_model import CHUNK, CTX, model, model_dir  # noqa: F401 (fixtures)


# --- attention blocks ---------------------------------------------------------------------------

@pytest.mark.parametrize("length", [1, 7, 127, 128, 129, 320, 3001])
def test_attention_blocks_cover_the_tile_and_depend_only_on_the_row(length):
    blocks_of_row = {}
    for tile in sorted({1, 7, 100, 127, 128, 129, 701, length}):
        covered = []
        for r0 in range(0, length, tile):
            r1 = min(r0 + tile, length)
            for b0, b1, lo, hi in attention_blocks(r0, r1, length):
                assert b0 % ATTENTION_ROWS == 0 and b1 == min(b0 + ATTENTION_ROWS, length)
                assert b0 <= lo < hi <= b1 and r0 <= lo and hi <= r1
                covered += range(lo, hi)
                for r in range(lo, hi):
                    assert blocks_of_row.setdefault(r, (b0, b1)) == (b0, b1), f"row {r}, tile {tile}"
        assert covered == list(range(length)), f"tile {tile}"


def test_window_key_indices_match_the_definition():
    num_prev, window = 5, 4
    got = np.array(window_key_indices(num_prev, 3, 9, window))
    expected = [[num_prev + r - window + 1 + j for j in range(window)] for r in range(3, 9)]
    assert got.tolist() == expected


# --- the fault class: batched products whose bits depend on the batch --------------------------

def _shape_sensitive_attention(q, groups, sinks, scale):
    """mixed attention whose row r of an n-row call is scaled by 1 + 2⁻²⁰·((7n + r) mod 5): what a
    GPU gemm does when its algorithm follows the batch (different bits, same maths)."""
    out = mixed_attention_reference(q, groups, sinks, scale)
    n = q.shape[0]
    wobble = 1 + 2.0**-20 * ((7 * n + mx.arange(n)) % 5).astype(mx.float32)
    return out * wobble[:, None, None].astype(out.dtype)


def _per_tile_blocks(r0, r1, length, block=ATTENTION_ROWS):
    """The code before the fix: one attention call shaped by the tile."""
    return [(r0, r1, r0, r1)]


def test_tiles_stay_exact_when_attention_bits_follow_the_batch(model, monkeypatch):
    monkeypatch.setattr(attention, "mixed_attention", _shape_sensitive_attention)
    tokens = random_tokens(model.cfg.vocab_size, CTX, seed=4)
    untiled = run_sequence(model, tokens, CTX, CHUNK, CHUNK)
    for tile in (7, 100, 129):
        tiled = run_sequence(model, tokens, CTX, CHUNK, tile)
        assert tiled.selections == untiled.selections
        assert np.array_equal(tiled.logits, untiled.logits), f"tile {tile}"
    # The same stand-in catches the old per-tile attention (issue 12's fault on the H200).
    monkeypatch.setattr(attention, "attention_blocks", _per_tile_blocks)
    old = run_sequence(model, tokens, CTX, CHUNK, 7)
    assert not np.array_equal(old.logits, untiled.logits)


# --- query / output projection blocks -----------------------------------------------------------

def _projection_inputs(model, rows: int):
    cfg, layer = model.cfg, 1  # a CSA layer: queries and index queries
    rng = np.random.default_rng(0)
    q_residual = mx.array(rng.standard_normal((rows, cfg.q_lora_rank), dtype=np.float32))
    cos = mx.array(rng.standard_normal((rows, cfg.qk_rope_head_dim // 2), dtype=np.float32))
    sin = mx.array(rng.standard_normal((rows, cfg.qk_rope_head_dim // 2), dtype=np.float32))
    tables = padded_rope_tables(cos, sin, cfg.head_dim), padded_rope_tables(cos, sin, cfg.index_head_dim)
    return q_residual, tables, model.layers[layer].attn, cfg, layer


@pytest.mark.parametrize("r0,r1", [(0, 1), (0, 256), (255, 257), (100, 613), (256, 512), (511, 700), (699, 700)])
def test_query_blocks_return_the_rows_asked_for(model, r0, r1):
    q_residual, (tables, index_tables), w, cfg, layer = _projection_inputs(model, 700)
    whole_q, whole_index_q = [], []
    for j in range(0, 700, PROJECTION_ROWS):  # every block by itself: the rows' true values
        blocks = attention._QueryBlocks(q_residual, tables, index_tables, w, cfg, layer)
        q, index_q = blocks.rows(j, min(j + PROJECTION_ROWS, 700))
        whole_q.append(q), whole_index_q.append(index_q)
    q, index_q = attention._QueryBlocks(q_residual, tables, index_tables, w, cfg, layer).rows(r0, r1)
    assert mx.array_equal(q, mx.concatenate(whole_q)[r0:r1]).item()
    assert mx.array_equal(index_q, mx.concatenate(whole_index_q)[r0:r1]).item()


@pytest.mark.parametrize("pieces", [[700], [1, 699], [255, 2, 443], [701 - 1], [128] * 5 + [60], [7] * 100])
def test_output_blocks_project_the_same_rows_whatever_the_pieces(model, pieces):
    q_residual, (tables, _), w, cfg, _ = _projection_inputs(model, 700)
    rng = np.random.default_rng(1)
    out = mx.array(rng.standard_normal((700, cfg.num_attention_heads, cfg.head_dim), dtype=np.float32))
    reference = attention._OutputBlocks(tables, w, cfg)
    reference.add(out)
    expected = reference.result()
    blocks, start = attention._OutputBlocks(tables, w, cfg), 0
    for n in pieces:
        blocks.add(out[start : start + n])
        start += n
    assert start == 700 and mx.array_equal(blocks.result(), expected).item()


# --- the CUDA kernels' index arithmetic, emulated -----------------------------------------------

@pytest.mark.parametrize("num_q,num_k", [(1, 1), (31, 255), (33, 257), (701, 750), (1, 3001), (64, 512)])
def test_indexer_kernel_writes_every_score_exactly_once(num_q, num_k):
    (gx, gy, _), (tx, _, _) = indexer_cuda.launch_shape(num_q, num_k)
    blocks_x, blocks_y = -(-gx // tx), gy  # MLX: ceil(grid / threadgroup) blocks per axis
    by, bx, warp, lane, m, half, n, e = np.meshgrid(
        np.arange(blocks_y), np.arange(blocks_x), np.arange(indexer_cuda.WARPS), np.arange(32),
        np.arange(2), np.arange(2), np.arange(4), np.arange(2), indexing="ij")
    group, tig = lane // 4, lane % 4
    t = by * indexer_cuda.QUERIES_PER_BLOCK + m * 16 + group + half * 8  # the kernel's output row
    s = bx * indexer_cuda.KEYS_PER_BLOCK + warp * indexer_cuda.KEYS_PER_WARP + n * 8 + tig * 2 + e
    written = (t < num_q) & (s < num_k)
    counts = np.zeros((num_q, num_k), dtype=np.int64)
    np.add.at(counts, (t[written], s[written]), 1)
    assert (counts == 1).all()


def test_indexer_kernel_query_loads_cover_the_tile_once():
    for d in (16, 64, 128, 256):
        loads = (indexer_cuda.QUERIES_PER_BLOCK * d // 8 + 255) // 256  # the kernel's LOADS
        i = np.arange(256)[:, None] + np.arange(loads)[None, :] * 256
        i = i[i < indexer_cuda.QUERIES_PER_BLOCK * d // 8]
        row, col = i // (d // 8), (i % (d // 8)) * 8
        assert sorted(zip(row.tolist(), col.tolist())) == [(r, c) for r in range(32) for c in range(0, d, 8)]


def test_indexer_kernel_is_not_dispatched_where_its_shared_memory_would_not_fit():
    assert indexer_cuda.shapes_fit(64, 128)  # V4 Flash's indexer
    assert indexer_cuda.shared_memory_bytes(256, 256) > indexer_cuda.SHARED_MEMORY_LIMIT
    assert not indexer_cuda.shapes_fit(256, 256) and not indexer_cuda.shapes_fit(64, 120)


def _order_keys(x: np.ndarray) -> np.ndarray:
    bits = np.where(x == 0, np.float32(0), x).astype(np.float32).view(np.uint32)
    return np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)


def _emulate_topk_row(x: np.ndarray, k: int, visible: int) -> tuple[np.ndarray, np.ndarray]:
    """topk_cuda's algorithm for one row, step for step: four radix passes, then per-warp stretches, each pick's
    validity (its row below `visible`) written at the pick's slot."""
    keys, n = _order_keys(x), x.shape[0]
    prefix, mask, remaining = 0, 0, k
    for shift in (24, 16, 8, 0):
        take = (keys & mask) == prefix
        hist = np.bincount(((keys[take] >> shift) & 0xFF).astype(np.int64), minlength=256)
        above, b = 0, 255
        while b > 0 and above + hist[b] < remaining:
            above += hist[b]
            b -= 1
        prefix, remaining, mask = prefix | (b << shift), remaining - above, mask | (0xFF << shift)
    kth, need = prefix, remaining
    stretch = topk_cuda.warp_stretch(n)
    spans = [(min(w * stretch, n), min(min(w * stretch, n) + stretch, n)) for w in range(topk_cuda.WARPS)]
    out, out_valid = np.full(k, -1), np.zeros(k, dtype=bool)
    above_before = ties_before = 0
    for lo, hi in spans:
        slot, ties_seen = above_before + min(ties_before, need), ties_before
        for base in range(lo, hi, 32):
            i = base + np.arange(32)
            ok = i < hi
            key = np.where(ok, keys[np.minimum(i, n - 1)], 0)
            tie = ok & (key == kth)
            pick = (ok & (key > kth)) | (tie & (ties_seen + np.cumsum(tie) - tie < need))
            out[slot + (np.cumsum(pick) - pick)[pick]] = i[pick]
            out_valid[slot + (np.cumsum(pick) - pick)[pick]] = i[pick] < visible
            ties_seen, slot = ties_seen + tie.sum(), slot + pick.sum()
        above_before += int((keys[lo:hi] > kth).sum())
        ties_before += int((keys[lo:hi] == kth).sum())
    return out, out_valid


@pytest.mark.parametrize("n", [1, 5, 31, 33, 750, 1023, 1025, 3001])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_topk_kernel_slots_equal_the_reference(n, ties):
    rng = np.random.default_rng(n)
    t = 4
    raw = (rng.integers(-3, 4, (t, n)) * 0.5 if ties else rng.standard_normal((t, n))).astype(np.float32)
    raw[rng.random((t, n)) < 0.05] = -0.0
    visible = rng.integers(0, n + 1, t)
    visible[0] = n
    scores = np.array(mask_invisible(mx.array(raw), mx.array(visible)))
    for k in sorted({1, min(16, n), min(512, n), n}):
        expected, expected_valid = select_topk_reference(mx.array(scores), mx.array(visible), k)
        got, got_valid = zip(*(_emulate_topk_row(row, k, int(v)) for row, v in zip(scores, visible)))
        assert np.stack(got).tolist() == np.array(expected).tolist(), f"k {k}"
        assert np.stack(got_valid).tolist() == np.array(expected_valid).tolist(), f"k {k}"


# --- tessera check gpu ----------------------------------------------------------------------------

def _check_gpu(model_dir, *extra) -> int:
    args = ["check", "gpu", "--model", str(model_dir), "--shape", f"{CTX}:{CHUNK}:7", "--shape", f"{CTX}:{CHUNK}:100",
            "--dtype", "float32", "--rows", "301", *extra]
    return commands.main(args)


@row_invariant_blas  # its row-invariance checks run the CPU references, whose gemms OpenBLAS makes row-variant
def test_check_gpu_passes_on_exact_code_and_fails_on_an_injected_fault(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(attention, "mixed_attention", _shape_sensitive_attention)
    assert _check_gpu(model_dir, "--allow-cpu") == 0
    assert "no violations" in capsys.readouterr().out
    monkeypatch.setattr(attention, "attention_blocks", _per_tile_blocks)  # the old per-tile attention
    assert _check_gpu(model_dir, "--allow-cpu") == 1
    out = capsys.readouterr().out
    assert "**NO**" in out and "VIOLATION: matrix: float32 ctx 403 chunk 320 tile 7" in out


def test_check_gpu_fails_when_the_device_disagrees_with_the_cpu(model_dir, monkeypatch, capsys):
    """The device-against-CPU part's rows reach the verdict (on this CPU it compares the CPU with itself,
    so the disagreement is injected where its rows come from)."""
    from tessera.engine.tools import device_agreement
    from tessera.engine.tools.device_agreement import AgreementRow

    rows = [AgreementRow("official", 5, "layer 1 (compressed_sparse_attention)", 0.9), AgreementRow("official", 5, "logits", 1e-3)]
    monkeypatch.setattr(device_agreement, "check_device_agreement", lambda *a, **k: rows)
    assert _check_gpu(model_dir, "--allow-cpu") == 1
    out = capsys.readouterr().out
    assert ("VIOLATION: device vs CPU: official checkpoint, prompt of 5, layer 1 (compressed_sparse_attention): "
            "relative difference 0.9") in out
    assert "VIOLATION: device vs CPU: official checkpoint, prompt of 5, logits" not in out  # 1e-3: TF32's size, within the limit


def test_check_gpu_refuses_to_pass_without_cuda_or_with_a_bad_shape(model_dir, capsys):
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert _check_gpu(model_dir) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert commands.main(["check", "gpu", "--model", str(model_dir), "--shape", "100:10:20", "--allow-cpu"]) == 2
