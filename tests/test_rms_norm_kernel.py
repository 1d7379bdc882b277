"""Where kernels/rms_norm_cuda.py's kernel runs (bf16 or fp16 rows on CUDA), engine/model/norms.py hands it the rows,
the weight (or none) and eps, for every norm of a step. Here a float64 NumPy stand-in of the kernel's contract takes
its place on the CPU: a model's logits must come out as the reference's within bf16 rounding, with every norm of
every layer through the stand-in. The kernel's own numbers are checked on a GPU (tests/test_kernels_cuda.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model import compiled
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tessera.kernels import rms_norm_cuda


def _stand_in(calls: list):
    def kernel(x, weight, eps):
        """The kernel's contract in float64: x · rsqrt(mean(x²) + eps) · w, rounded once to x's dtype."""
        assert x.dtype == mx.bfloat16 and (weight is None or weight.shape == (x.shape[-1],))
        calls.append("weighted" if weight is not None else "unweighted")
        x64 = np.array(x.astype(mx.float32), dtype=np.float64)
        out = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
        if weight is not None:
            out = out * np.array(weight.astype(mx.float32), dtype=np.float64)
        return mx.array(out.astype(np.float32)).astype(x.dtype)
    return kernel


def _logits(model) -> np.ndarray:
    """A 40-token prompt, then two decode steps: every norm of prefill and decode."""
    cache = model.new_cache()
    out = [model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, 40, 3))])[0][-1]]
    out += [model.forward([Segment(cache, [5 + s])])[0][-1] for s in range(2)]
    return np.array(mx.stack(out).astype(mx.float32))


def test_every_norm_of_a_step_goes_to_the_kernel_where_it_runs(tmp_path, monkeypatch):
    model = load_model(make_model(tmp_path / "m", "tiny", seed=4, with_tokenizer=False), dtype="bfloat16")
    reference = _logits(model)
    calls: list[str] = []
    monkeypatch.setattr(rms_norm_cuda, "_switch", rms_norm_cuda.Switch(rms_norm_cuda.ENV_VAR, default=True))
    monkeypatch.setattr(rms_norm_cuda, "on_cuda", lambda: True)
    monkeypatch.setattr(rms_norm_cuda, "compile_enabled", lambda: True)
    monkeypatch.setattr(rms_norm_cuda, "rms_norm_kernel", _stand_in(calls))
    got = _logits(model)
    layers = model.cfg.num_hidden_layers
    # a step's layers: q_a's, kv's, the heads' q (unweighted), attention's and the FFN's at least; the head's once
    assert calls.count("unweighted") >= 3 * layers and calls.count("weighted") >= 3 * (4 * layers + 1)
    scale = np.abs(reference).max()
    assert np.abs(got - reference).max() <= 0.05 * scale, float(np.abs(got - reference).max() / scale)
    assert np.argmax(got, axis=-1).tolist() == np.argmax(reference, axis=-1).tolist()


def test_the_kernel_takes_bf16_and_fp16_rows_of_a_width_it_holds(monkeypatch):
    monkeypatch.setattr(rms_norm_cuda, "_switch", rms_norm_cuda.Switch(rms_norm_cuda.ENV_VAR, default=True))
    monkeypatch.setattr(rms_norm_cuda, "on_cuda", lambda: True)
    monkeypatch.setattr(rms_norm_cuda, "compile_enabled", lambda: True)
    supported = rms_norm_cuda.is_supported
    assert supported(mx.zeros((3, 4096), dtype=mx.bfloat16)) and supported(mx.zeros((2, 64, 512), dtype=mx.float16))
    assert not supported(mx.zeros((3, 512), dtype=mx.float32))  # float32 rows: MLX's norm is one launch already
    assert not supported(mx.zeros((3, 44), dtype=mx.bfloat16))  # not whole 16-byte pieces
    assert not supported(mx.zeros((3, rms_norm_cuda.MAX_WIDTH + 8), dtype=mx.bfloat16))  # past the lanes' registers
    assert not supported(mx.zeros((0, 512), dtype=mx.bfloat16))
    monkeypatch.setattr(rms_norm_cuda, "_switch", rms_norm_cuda.Switch(rms_norm_cuda.ENV_VAR, default=False))
    assert not supported(mx.zeros((3, 512), dtype=mx.bfloat16))
    monkeypatch.setattr(rms_norm_cuda, "_switch", rms_norm_cuda.Switch(rms_norm_cuda.ENV_VAR, default=True))
    monkeypatch.setattr(rms_norm_cuda, "on_cuda", lambda: False)
    assert not supported(mx.zeros((3, 512), dtype=mx.bfloat16))


def test_a_compiled_step_is_traced_anew_when_the_switch_flips():
    """A compiled step part replays the norm it was traced with: the switch is in its trace key."""
    before = compiled._trace_switches()
    rms_norm_cuda.set_kernel_enabled(not rms_norm_cuda.kernel_enabled())
    try:
        assert compiled._trace_switches() != before
    finally:
        rms_norm_cuda.set_kernel_enabled(not rms_norm_cuda.kernel_enabled())
    assert compiled._trace_switches() == before


@pytest.mark.parametrize("value, expected", [(None, "True"), ("0", "False"), ("1", "True")])  # on by default
def test_the_switch_reads_its_environment_variable(value, expected):
    from tests.support.env_switch import switch_in_fresh_process

    assert switch_in_fresh_process(rms_norm_cuda.ENV_VAR, value, "tessera.kernels.rms_norm_cuda", "kernel_enabled") == expected
