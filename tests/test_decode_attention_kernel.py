"""Where kernels/decode_attention_cuda.py's kernel runs (a CUDA decode batch), the engine hands it each layer's
query, its groups of rows (the window; CSA's selected or HCA's compressed rows) and the sinks, and a prefill tile
never takes it. Here a float64 NumPy stand-in of the kernel's contract takes its place on the CPU: a decode must
come out as the reference's within float32 rounding. The kernel's own numbers are checked on the H200
(tests/test_kernels_cuda.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tessera.kernels import decode_attention_cuda

OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32}, head_dim=256,
                 index_n_heads=8, num_attention_heads=16)  # the kernels' head tiles: a multiple of 16


def _stand_in(calls: list):
    def kernel(q, groups, sinks, scale):
        """The kernel's contract in float64: softmax over every valid row's scaled product and the head's sink."""
        tokens, heads, dim = q.shape
        assert sinks.shape == (heads,) and all(r.shape[0] == tokens and r.shape[2] == dim for r, _ in groups)
        calls.append(len(groups))
        f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
        rows = np.concatenate([f64(r) for r, _ in groups], axis=1)
        valid = np.concatenate([np.array(v) for _, v in groups], axis=1)
        logits = np.where(valid[:, None, :], np.einsum("thd,trd->thr", f64(q), rows) * scale, -np.inf)
        sink = np.broadcast_to(f64(sinks)[None, :, None], (tokens, heads, 1))
        both = np.concatenate([logits, sink], axis=-1)
        p = np.exp(both - both.max(axis=-1, keepdims=True))
        p = (p / p.sum(axis=-1, keepdims=True))[..., :-1]
        return mx.array(np.einsum("thr,trd->thd", p, rows).astype(np.float32)).astype(q.dtype)
    return kernel


def _decode_logits(model, steps: int) -> list[np.ndarray]:
    """Two sequences of 150 and 97 prompt tokens (every layer has compressed rows), decoded together."""
    caches = [model.new_cache(), model.new_cache()]
    for cache, (length, seed) in zip(caches, ((150, 1), (97, 2))):
        model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, length, seed))], tile=16)
    out = []
    for s in range(steps):
        logits = model.forward([Segment(c, [3 + s]) for c in caches])
        out.append(np.array(mx.stack([lg[-1] for lg in logits]) if isinstance(logits, list) else logits))
    return out


def test_decode_hands_the_attention_kernel_its_operands_and_prefill_never_takes_it(tmp_path, monkeypatch):
    model = load_model(make_model(tmp_path / "m", "tiny", seed=4, with_tokenizer=False, **OVERRIDES), dtype="float32")
    reference = _decode_logits(model, 3)
    calls: list[int] = []
    monkeypatch.setattr(decode_attention_cuda, "on_cuda", lambda: True)
    monkeypatch.setattr(decode_attention_cuda, "compile_enabled", lambda: True)
    monkeypatch.setattr(decode_attention_cuda, "decode_attention_kernel", _stand_in(calls))
    monkeypatch.setattr(decode_attention_cuda, "DTYPES", (mx.float32,))  # the stand-in's contract holds in any dtype
    caches = [model.new_cache()]
    model.forward([Segment(caches[0], random_tokens(model.cfg.vocab_size, 40, 9))], tile=1)  # one-row tiles: no kernel
    assert calls == []
    got = _decode_logits(model, 3)
    # a step: the window layer one group, the CSA and HCA layers two each (the two sequences' N differ: HCA per N)
    assert calls[:4] == [1, 2, 2, 2] and len(calls) >= 3 * 4, calls
    for a, b in zip(got, reference):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5), float(np.max(np.abs(a - b)))


def test_the_kernel_is_chosen_by_a_rows_own_sizes_and_the_switch(monkeypatch):
    monkeypatch.setattr(decode_attention_cuda, "on_cuda", lambda: True)
    monkeypatch.setattr(decode_attention_cuda, "compile_enabled", lambda: True)
    q = mx.zeros((3, 64, 512), dtype=mx.bfloat16)
    group = lambda rows, dtype=mx.bfloat16: (mx.zeros((3, rows, 512), dtype=dtype), mx.ones((3, rows), dtype=mx.bool_))  # noqa: E731
    supported = decode_attention_cuda.is_supported
    assert supported(q, [group(128)]) and supported(q, [group(128), group(512)])
    assert supported(q, [group(128), group(0)])  # a CSA layer before its first compressed row: the window alone
    assert not supported(q, [group(0), group(128)])  # no window rows: the kernel's first group must have some
    assert supported(q, [group(128), group(decode_attention_cuda.MAX_ATTENDED - 128)])
    assert not supported(q, [group(128), group(decode_attention_cuda.MAX_ATTENDED - 127)])  # HCA far out: MLX's
    assert not supported(q, [group(128), group(512, mx.float16)])  # the groups in q's dtype
    assert supported(q.astype(mx.float16), [group(128, mx.float16)])
    assert not supported(q.astype(mx.float32), [group(128, mx.float32)])  # no float32 tensor-core path: the reference
    for heads in (8, 24, 256):  # the head tiles (16) and the shared statistics (MAX_HEADS)
        assert not supported(mx.zeros((3, heads, 512), dtype=mx.bfloat16), [group(128)])
    assert supported(mx.zeros((3, 128, 512), dtype=mx.bfloat16), [group(128)])
    for dim in (48, 200):  # a head dim not a multiple of the output kernel's COLUMNS
        assert not supported(mx.zeros((3, 64, dim), dtype=mx.bfloat16),
                             [(mx.zeros((3, 128, dim), dtype=mx.bfloat16), mx.ones((3, 128), dtype=mx.bool_))])
    monkeypatch.setattr(decode_attention_cuda, "_switch", decode_attention_cuda.Switch(decode_attention_cuda.ENV_VAR, default=False))
    assert not supported(q, [group(128)])
    monkeypatch.setattr(decode_attention_cuda, "on_cuda", lambda: False)
    monkeypatch.setattr(decode_attention_cuda, "_switch", decode_attention_cuda.Switch(decode_attention_cuda.ENV_VAR, default=True))
    assert not supported(q, [group(128)])


def test_the_output_kernels_heads_a_block_depend_on_the_heads_only(monkeypatch):
    """64 heads a block where they divide the heads (V4's 64: a block a token and 64 columns), else one tile's 16;
    a probe's forced layout where it divides them; a layout the shared arrays do not hold is refused."""
    assert [decode_attention_cuda.block_heads(h) for h in (16, 48, 64, 128)] == [16, 16, 64, 64]
    assert decode_attention_cuda.output_threads(64) == 256  # (64 heads / 16) x (64 columns / 32) warps
    monkeypatch.setattr(decode_attention_cuda, "_forced_block_heads", 32)
    assert [decode_attention_cuda.block_heads(h) for h in (16, 64, 128)] == [16, 32, 32]
    with pytest.raises(ValueError, match="heads a block"):
        decode_attention_cuda.force_block_heads(128)


@pytest.mark.parametrize("value, expected", [(None, "True"), ("0", "False"), ("1", "True")])
def test_the_switch_reads_its_environment_variable(value, expected):
    from tests.support.env_switch import switch_in_fresh_process

    assert switch_in_fresh_process(decode_attention_cuda.ENV_VAR, value, "tessera.kernels.decode_attention_cuda",
                                   "kernel_enabled") == expected
