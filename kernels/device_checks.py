"""Kernel-vs-reference checks that need the device the kernel runs on (`tessera check kernels`, and
tests/test_kernels_cuda.py), and the indexer throughput benchmark against the device's own bf16 matmul rate
(`tessera bench indexer`). On a machine without the kernel, they say so. `kernel_failures` turns a check's
report into pass/fail against thresholds the CLI exposes as flags."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from tessera.kernels import indexer_cuda, topk_cuda
from tessera.kernels.indexer import indexer_scores_reference, select_topk_reference, select_topk_threshold


def _inputs(rng: np.random.Generator, t: int, n: int, heads: int, dim: int, integer: bool):
    """Integer-valued inputs make every product and sum exact in fp32 (so kernel and reference must
    agree bit for bit, and ties are everywhere); normal inputs are the realistic case."""
    if integer:
        q = rng.integers(-2, 3, (t, heads, dim)).astype(np.float32)
        k = rng.integers(-2, 3, (n, dim)).astype(np.float32)
        w = rng.choice(np.array([-1.0, -0.5, 0.5, 1.0, 2.0], dtype=np.float32), (t, heads))
    else:
        q = rng.standard_normal((t, heads, dim), dtype=np.float32)
        k = rng.standard_normal((n, dim), dtype=np.float32)
        w = rng.standard_normal((t, heads), dtype=np.float32)
    visible = rng.integers(0, n + 1, t).astype(np.int32)
    visible[: t // 4] = n  # a quarter sees every row
    bf = lambda a: mx.array(a).astype(mx.bfloat16)  # noqa: E731
    return bf(q), mx.array(w), bf(k), mx.array(visible)


UNAVAILABLE = "unavailable on this device"


def kernel_failures(report: dict, max_rel_diff: float, max_differing_rows: int) -> list[str]:
    """One line per exceeded threshold in a `check_indexer_kernel` report (empty: passed); the thresholds are
    the caller's (`check kernels`' flags, defaults in engine/tools/check_limits.py). Integer-valued
    inputs ("ties") make every product exact, so there the kernel must equal the reference bit for bit."""
    if report.get("kernel") == UNAVAILABLE:
        return []
    out = []
    for case in ("ties", "random"):
        r = report[case]
        limit = 0.0 if case == "ties" else max_rel_diff
        if r["max_rel_diff"] > limit:
            out.append(f"{case}: max_rel_diff = {r['max_rel_diff']} exceeds {limit}"
                       + ("" if case == "ties" else " (--max-rel-diff)"))
        if not r["masks_equal"]:
            out.append(f"{case}: the kernel masks other rows than the reference")
        if r["differing_selection_rows"] > max_differing_rows:
            out.append(f"{case}: {r['differing_selection_rows']} rows select differently "
                       f"(--max-differing-rows {max_differing_rows})")
    if not report["tile_invariant"]:
        out.append("a row's kernel scores depend on the tile it is computed in")
    if report.get("batched_equals_single") is False:  # reports from before this check lack the key
        out.append("the batched (decode) kernel's scores differ from the single kernel's")
    topk = report["topk_kernel"]  # {"kernel": UNAVAILABLE} or one result per case
    for case in ("random", "ties"):
        if case in topk and topk[case]["differing_rows"] > max_differing_rows:
            out.append(f"top-k kernel, {case}: {topk[case]['differing_rows']} rows differ from the reference "
                       f"(--max-differing-rows {max_differing_rows})")
    return out


def _valid_rows(selection) -> list[tuple[int, ...]]:
    rows, valid = (np.array(a) for a in selection)
    return [tuple(r[v]) for r, v in zip(rows, valid)]


def check_indexer_kernel(t: int = 512, n: int = 65536, heads: int = 64, dim: int = 128, k: int = 512, seed: int = 0) -> dict:
    if not indexer_cuda.is_supported(mx.zeros((1, heads, dim), dtype=mx.bfloat16)):
        return {"kernel": UNAVAILABLE, "device": str(mx.default_device())}
    rng = np.random.default_rng(seed)
    report: dict = {"shape": {"tile": t, "rows": n, "heads": heads, "dim": dim, "topk": k}}
    for name, integer in (("ties", True), ("random", False)):
        q, w, keys, visible = _inputs(rng, t, n, heads, dim, integer)
        ref = indexer_scores_reference(q, w, keys, visible, 1.0)
        got = indexer_cuda.indexer_scores_kernel(q, w, keys, visible, 1.0)
        finite = mx.isfinite(ref)
        diff = mx.where(finite, mx.abs(got - ref), 0.0)
        scale = mx.max(mx.where(finite, mx.abs(ref), 0.0))
        same_mask = mx.array_equal(mx.isfinite(got), finite)
        sel_ref = _valid_rows(select_topk_reference(ref, visible, k))
        sel_got = _valid_rows(select_topk_threshold(got, visible, k))
        report[name] = {
            "max_abs_diff": float(mx.max(diff).item()),
            "max_rel_diff": float((mx.max(diff) / scale).item()),
            "masks_equal": bool(same_mask.item()),
            "differing_selection_rows": sum(a != b for a, b in zip(sel_ref, sel_got)),
            "rows": t,
        }
    # A row's scores do not depend on the tile it is computed in.
    q, w, keys, visible = _inputs(rng, t, n // 4, heads, dim, False)
    whole = indexer_cuda.indexer_scores_kernel(q, w, keys, visible, 1.0)
    lo, hi = 37, 37 + 45
    part = indexer_cuda.indexer_scores_kernel(q[lo:hi], w[lo:hi], keys, visible[lo:hi], 1.0)
    report["tile_invariant"] = bool(mx.array_equal(part, whole[lo:hi]).item())
    report["batched_equals_single"] = check_batched_indexer_kernel(rng, heads, dim, n // 16)
    report["topk_kernel"] = check_topk_kernel(rng, t, n, k)
    return report


def check_batched_indexer_kernel(rng: np.random.Generator, heads: int, dim: int, n: int, batch: int = 17) -> bool:
    """The decode batch kernel (one launch over every sequence's own key buffer) against the single
    kernel on each sequence alone, bit for bit: equal and different key counts, more sequences than
    one launch takes (indexer_cuda.MAX_BATCH), -inf past each sequence's keys."""
    counts = [n if b % 4 else max(1, n - 97 * b) for b in range(batch)]
    q, w, _, _ = _inputs(rng, batch, 1, heads, dim, False)
    buffers = [_inputs(rng, 1, c + 29, 1, dim, False)[2] for c in counts]  # 29 spare rows past each sequence's keys
    visible = mx.array([c if b % 2 else int(rng.integers(0, c + 1)) for b, c in enumerate(counts)], dtype=mx.int32)
    got = indexer_cuda.indexer_scores_batched_kernel(q, w, buffers, counts, visible, 1.0)
    same = []
    for b, c in enumerate(counts):
        alone = indexer_cuda.indexer_scores_kernel(q[b : b + 1], w[b : b + 1], buffers[b][:c], visible[b : b + 1], 1.0)
        same.append(mx.array_equal(got[b : b + 1, :c], alone) & mx.all(got[b, c:] == -mx.inf))
    return bool(mx.all(mx.stack(same)).item())


def _tie_scores(rng: np.random.Generator, t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Scores with few distinct values (ties at the k-th place in nearly every row), signed zeros,
    and masked (-inf) tails; some rows see fewer than k rows."""
    scores = rng.integers(-3, 4, (t, n)).astype(np.float32) * np.float32(0.5)
    scores[rng.random((t, n)) < 0.05] = -0.0
    visible = rng.integers(0, n + 1, t)
    visible[: t // 4] = n
    few = min(8, t - t // 4)
    visible[t // 4 : t // 4 + few] = rng.integers(0, 64, few)  # fewer visible rows than k
    scores[np.arange(n)[None, :] >= visible[:, None]] = -np.inf
    return scores, visible.astype(np.int32)


def check_topk_kernel(rng: np.random.Generator, t: int, n: int, k: int) -> dict:
    """The radix-select kernel against the stable-sort reference: rows and validity must be equal."""
    if not topk_cuda.is_supported(mx.zeros((1, 1), dtype=mx.float32)):
        return {"kernel": UNAVAILABLE}
    out = {}
    for name in ("random", "ties"):
        if name == "random":
            scores = rng.standard_normal((t, n), dtype=np.float32)
            visible = np.full(t, n, dtype=np.int32)
        else:
            scores, visible = _tie_scores(rng, t, n)
        scores, visible = mx.array(scores), mx.array(visible)
        ref_rows, ref_valid = select_topk_reference(scores, visible, k)
        got_rows, got_valid = topk_cuda.select_topk_kernel(scores, visible, k)
        differing = mx.any((ref_rows != got_rows) | (ref_valid != got_valid), axis=-1)
        out[name] = {"differing_rows": int(mx.sum(differing).item()), "rows": t}
    return out


def _median_seconds(fn, repeat: int) -> float:
    mx.eval(fn())  # warm-up: compilation, allocation
    times = []
    for _ in range(repeat):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_indexer(t: int = 1024, n: int = 262144, heads: int = 64, dim: int = 128, k: int = 512, repeat: int = 5) -> dict:
    """Indexer score throughput (kernel and reference) and top-k time, with the bf16 matmul rate
    measured in the same process as the yardstick."""
    rng = np.random.default_rng(0)
    q, w, keys, visible = _inputs(rng, t, n, heads, dim, False)
    visible = mx.full((t,), n, dtype=mx.int32)
    flops = 2.0 * t * n * heads * dim
    on_gpu = mx.default_device() == mx.gpu
    size, dtype = (8192, mx.bfloat16) if on_gpu else (2048, mx.float32)  # bf16 matmul on a CPU crawls
    a = mx.random.normal((size, size)).astype(dtype)
    matmul_s = _median_seconds(lambda: a @ a, repeat)
    out = {"tile": t, "rows": n, "heads": heads, "dim": dim, "indexer_flops": flops,
           "matmul": f"{size}^3 {dtype}", "matmul_tflops": 2 * size**3 / matmul_s / 1e12}
    ref_s = _median_seconds(lambda: indexer_scores_reference(q, w, keys, visible, 1.0), repeat)
    out["reference_seconds"], out["reference_tflops"] = ref_s, flops / ref_s / 1e12
    if indexer_cuda.is_supported(q):
        kern_s = _median_seconds(lambda: indexer_cuda.indexer_scores_kernel(q, w, keys, visible, 1.0), repeat)
        out["kernel_seconds"], out["kernel_tflops"] = kern_s, flops / kern_s / 1e12
        out["kernel_vs_matmul"] = out["kernel_tflops"] / out["matmul_tflops"]
        scores = indexer_cuda.indexer_scores_kernel(q, w, keys, visible, 1.0)
    else:
        scores = indexer_scores_reference(q, w, keys, visible, 1.0)
    mx.eval(scores)
    if topk_cuda.is_supported(scores):
        out["topk_kernel_seconds"] = _median_seconds(lambda: topk_cuda.select_topk_kernel(scores, visible, k), repeat)
    out["topk_threshold_seconds"] = _median_seconds(lambda: select_topk_threshold(scores, visible, k), repeat)
    out["topk_argsort_seconds"] = _median_seconds(lambda: select_topk_reference(scores, visible, k), max(1, repeat // 2))
    return out
