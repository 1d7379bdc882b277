"""Rank 0's pipeline runner joins the followers' memory all_gather only when its StepMessage says so: the first
step that runs tokens, then one step per interval (engine/parallel/serving.py), never every step."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from tessera.engine.parallel import serving
from tessera.engine.parallel.messages import StepMessage
from tessera.engine.serving.protocol import DecodeSlot, StepOutput, StepPlan

DECODE = StepPlan(decodes=(DecodeSlot("a", 5, 3),))


class _Recorder:
    """The stage's transport and the runner it wraps: records what rank 0 tells and how often it snapshots."""

    def __init__(self):
        self.told: list[StepMessage] = []
        self.snapshots = 0

    def broadcast_bytes(self, data: bytes) -> bytes:
        self.told.append(StepMessage.decode(data))
        return data

    def execute(self, plan: StepPlan) -> StepOutput:
        return StepOutput()

    def memory_snapshot(self) -> dict[str, int]:
        self.snapshots += 1
        return {"weights": 1, "kv_cache": 2}


def _pipeline(interval_s: float, monkeypatch) -> tuple[serving.PipelineRunner, _Recorder, list[int]]:
    recorder, gathers = _Recorder(), []

    def gather(group, weights_bytes, kv_cache_bytes):
        gathers.append(1)
        return serving.np.array([[0] * 5, [7, 8, 9, 10, 11]])  # rank 0's row, then the follower's

    monkeypatch.setattr(serving, "gather_memory", gather)
    stage = SimpleNamespace(group=mx.distributed.init(), transport=recorder)
    return serving.PipelineRunner(recorder, stage, memory_gather_interval_s=interval_s), recorder, gathers


def test_memory_is_gathered_on_the_first_step_then_once_per_interval(monkeypatch):
    runner, recorder, gathers = _pipeline(3600.0, monkeypatch)
    runner.execute(StepPlan())  # no tokens: nothing to gather
    for _ in range(5):
        runner.execute(DECODE)
    assert [m.gather_memory for m in recorder.told] == [False, True, False, False, False, False]
    assert len(gathers) == 1 and recorder.snapshots == 0  # the step itself takes no memory snapshot
    assert runner.memory_snapshot()["rank1_kv_cache"] == 8


@pytest.mark.parametrize("interval_s, expected", [(0.0, 4), (3600.0, 1)])
def test_the_interval_sets_how_many_steps_gather(monkeypatch, interval_s, expected):
    runner, recorder, gathers = _pipeline(interval_s, monkeypatch)
    for _ in range(4):
        runner.execute(DECODE)
    assert len(gathers) == expected == sum(m.gather_memory for m in recorder.told)


def test_the_gather_flag_survives_the_wire():
    assert StepMessage.decode(StepMessage.of(DECODE, gather_memory=True).encode()).gather_memory
    assert not StepMessage.decode(StepMessage.of(DECODE).encode()).gather_memory
