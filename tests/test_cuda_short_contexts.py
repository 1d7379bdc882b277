"""Contexts shorter than a layer's compression ratio on a CUDA device: an HCA or CSA layer then has no
compressed row yet, and its attention group is empty. On the H200 (MLX 0.32.4) a 5-token prefill of the
`tiny` model ended the process with a segfault inside such a layer's attention until
kernels/sparse_attention.py left empty groups out (docs/BENCHMARKS.md, "Session 8 on the H200"); this
runs the case end to end on the device: prompts of 1 to 31 tokens (HCA ratio 32, CSA 4) prefilled tiled
and untiled (the same bits, the tiling promise), then decoded together, every logit finite.

Not compared with the CPU here: on the H200 the GPU's logits for a 1-token prompt were not the CPU's,
by far more than TF32 explains (docs/BENCHMARKS.md, "Session 8 on the H200"); that comparison is
`check gpu`'s, layer by layer where nothing discrete can flip (engine/tools/device_agreement.py). Skipped without CUDA (tests/skip_allowlist.txt); the CPU form of the contract is
tests/test_kernels.py::test_a_group_without_rows_adds_nothing_and_runs_no_product."""

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


def _bits(x: mx.array) -> np.ndarray:
    return np.array(x).view(np.uint32)


def test_prompts_shorter_than_the_compression_ratios_prefill_and_decode_on_the_device(tmp_path):
    path = make_model(tmp_path / "m", "tiny", seed=8, with_tokenizer=False, layer_types=[WINDOW, CSA, HCA, CSA],
                      num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
    model = load_model(path, dtype="float32")
    prompts = [random_tokens(model.cfg.vocab_size, n, seed) for seed, n in enumerate(LENGTHS)]
    caches = [model.new_cache() for _ in LENGTHS]
    for cache, prompt in zip(caches, prompts):
        tiled = model.forward([Segment(cache, prompt)], tile=4, all_logits=True)[0]
        untiled = model.forward([Segment(model.new_cache(), prompt)], all_logits=True)[0]
        assert np.isfinite(np.array(tiled)).all()
        assert np.array_equal(_bits(tiled), _bits(untiled)), f"prompt of {len(prompt)} tokens: tiled != untiled"
    for step in range(DECODE_STEPS):  # every sequence one token further, together
        logits = model.forward([Segment(c, [7 * i + step]) for i, c in enumerate(caches)])
        assert all(np.isfinite(np.array(x)).all() for x in logits)
    assert [c.num_tokens for c in caches] == [n + DECODE_STEPS for n in LENGTHS]
