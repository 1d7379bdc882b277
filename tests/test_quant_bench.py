"""engine/tools/quant_bench.py: the three settings run what they name (the served rule, quantized_matmul
only, dequantized bf16), and the --matmul micro-bench times every way a projection can run."""

from __future__ import annotations

import pytest

from tessera.engine.model import quantized
from tessera.engine.model.quantized import QuantizedWeight
from tessera.engine.tools import quant_bench
from tessera.engine.tools.make_model import make_model


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qbench"), "tiny", seed=2, with_tokenizer=False, fmt="official")


def test_bench_runs_the_served_rule_the_qmm_only_path_and_bf16(official_dir, monkeypatch):
    seen: list[tuple[bool, int]] = []  # (model computes on quantized weights, dense_min_rows() during the run)
    timed = quant_bench._timed

    def spy(model, *args):
        seen.append((isinstance(model.weights["layers.0.attn.wq_b.weight"], QuantizedWeight), quantized.dense_min_rows()))
        return timed(model, *args)

    monkeypatch.setattr(quant_bench, "_timed", spy)
    out = quant_bench.bench(official_dir, ctx=300, chunk=300, decode=3, rounds=2)
    rule = out["dense_min_rows"]
    assert rule == quantized.dense_min_rows() and 300 >= rule  # the prefill chunk takes the dense path
    timed_runs = seen[3:]  # after one warm-up per setting
    assert sorted(set(timed_runs)) == [(False, rule), (True, rule), (True, quant_bench.NEVER_DENSE)]
    assert len(timed_runs) == 6
    for name in ("quantized", "quantized_qmm", "bf16"):
        assert out[name]["prefill_s"] > 0 and out[name]["decode_step_s"] > 0 and len(out[name]["runs"]) == 2
    assert out["quantized"]["weight_bytes"] < out["bf16"]["weight_bytes"]


def test_matmul_bench_times_every_path_per_row_count():
    out = quant_bench.matmul_bench("tiny", [1, 256], repeat=1)
    for rows in (1, 256):
        for name in ("wq_b", "wo_b", "shared_w1"):
            assert set(out["rows"][rows][name]) == {"quantized_matmul_s", "linear_s", "dequantize_then_matmul_s", "resident_dense_s"}
            assert all(v > 0 for v in out["rows"][rows][name].values())
        assert out["rows"][rows]["experts_w1"]["gather_qmm_s"] > 0
