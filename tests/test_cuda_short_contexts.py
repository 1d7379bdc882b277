"""Contexts shorter than a layer's compression ratio on a CUDA device: an HCA or CSA layer then has no
compressed row yet, and its attention group is empty. MLX 0.32.4's CUDA matmul segfaults on a product
over a zero-length axis, which ended the process on a 5-token prompt on the H200 (docs/BENCHMARKS.md,
"Session 8 on the H200"); kernels/sparse_attention.py now leaves such groups out, and this runs the case
end to end on the device: prompts of 1 to 31 tokens (HCA ratio 32, CSA 4) prefilled, then decoded
together, every logit finite and close to the CPU's. Skipped without CUDA (tests/skip_allowlist.txt);
the CPU form of the contract is tests/test_kernels.py::test_a_group_without_rows_adds_nothing_and_runs_no_product."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tessera.kernels.cuda import on_cuda

pytestmark = pytest.mark.skipif(not on_cuda(), reason="needs a CUDA device (MLX's CUDA build)")

LENGTHS = (1, 3, 5, 31)  # all below the HCA ratio (32); 1 and 3 below the CSA ratio (4) too
DECODE_STEPS = 3


def _run(model) -> list[np.ndarray]:
    """Each prompt prefilled alone (tile 16), then DECODE_STEPS steps of all of them together (fixed tokens:
    a greedy pick could differ between devices on a near tie and make the runs diverge)."""
    caches = [model.new_cache() for _ in LENGTHS]
    logits = [model.forward([Segment(c, random_tokens(model.cfg.vocab_size, n, seed))], tile=16)[0]
              for seed, (c, n) in enumerate(zip(caches, LENGTHS))]
    out = [np.array(x.astype(mx.float32)) for x in logits]
    for step_index in range(DECODE_STEPS):
        step = model.forward([Segment(c, [7 * i + step_index]) for i, c in enumerate(caches)])
        out += [np.array(x.astype(mx.float32)) for x in step]
    return out


def test_prompts_shorter_than_the_compression_ratios_prefill_and_decode_on_the_device(tmp_path):
    path = make_model(tmp_path / "m", "tiny", seed=8, with_tokenizer=False, layer_types=[WINDOW, CSA, HCA, CSA],
                      num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
    on_gpu = _run(load_model(path, dtype="float32"))
    with mx.stream(mx.cpu):
        on_cpu = _run(load_model(path, dtype="float32"))
    assert len(on_gpu) == len(LENGTHS) * (1 + DECODE_STEPS)
    for got, want in zip(on_gpu, on_cpu):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * float(np.abs(want).max()))
