"""Batched == single on the real model: a sequence's logits, tokens and logprobs do not depend on which other
sequences share its steps, and a seeded request draws the same tokens alone or among others.

Float32 on a tiny random checkpoint, with a row-invariant BLAS (`row_invariant_blas`): several sequences of
different lengths, prefill chunks and decodes mixed in one step, each compared bit for bit with the same
sequence run alone. The engine-level tests drive the real ModelRunner through the real EngineLoop, so the
scheduler's plans, the runner's batching and the sampler are all on the path.
"""

from __future__ import annotations

import numpy as np
import pytest

from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.serving.engine_loop import EngineLoop
from tessera.engine.serving.protocol import Done, Event, SamplingParams, StepStats, Token
from tessera.engine.serving.request import Request
from tessera.engine.serving.runner import ModelRunner
from tessera.engine.serving.scheduler import SchedulerConfig
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tests.equivalence.row_invariant_blas import row_invariant_blas

CHUNK = 16  # the step's token budget: long prompts prefill over several steps while others decode
TILE = 8
PROMPT_LENGTHS = {"a": 5, "b": 23, "c": 61, "d": 40}  # "a" decodes while "b", "c", "d" prefill in chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("batched"), "tiny", seed=5, with_tokenizer=False)


def prompts(vocab_size: int) -> dict[str, list[int]]:
    return {rid: random_tokens(vocab_size, n, seed=i) for i, (rid, n) in enumerate(PROMPT_LENGTHS.items())}


# ---- the model: one forward over mixed segments ----------------------------------------------------------


@row_invariant_blas
def test_mixed_segments_in_one_forward_equal_each_sequence_alone(model_dir):
    model = load_model(model_dir, dtype="float32")
    seqs = prompts(model.cfg.vocab_size)

    def alone(tokens: list[int]) -> np.ndarray:
        return np.array(model.forward([Segment(model.new_cache(), tokens)], tile=TILE, all_logits=True)[0])

    expected = {rid: alone(tokens) for rid, tokens in seqs.items()}
    # "a" and "b" have their prompt minus one token cached; "c" has 20; "d" nothing. One forward then runs a
    # decode of "a", a decode of "b", a 17-token chunk of "c" and the first 9 tokens of "d".
    caches = {rid: model.new_cache() for rid in seqs}
    prefix = {"a": len(seqs["a"]) - 1, "b": len(seqs["b"]) - 1, "c": 20, "d": 0}
    run = {"a": 1, "b": 1, "c": 17, "d": 9}
    for rid, n in prefix.items():
        if n:
            model.forward([Segment(caches[rid], seqs[rid][:n])], tile=TILE)
    segments = [Segment(caches[rid], seqs[rid][prefix[rid] : prefix[rid] + run[rid]]) for rid in seqs]
    logits = model.forward(segments, tile=TILE, all_logits=True)
    for rid, got in zip(seqs, logits):
        want = expected[rid][prefix[rid] : prefix[rid] + run[rid]]
        assert np.array_equal(np.array(got), want), f"sequence {rid!r} differs when batched"
    last_only = model.forward([Segment(c, [7]) for c in caches.values()], tile=TILE)  # the sampling path
    assert len(last_only) == len(seqs) and all(row.shape == (1, model.cfg.vocab_size) for row in last_only)


# ---- the engine: scheduler -> runner -> sampler, alone vs together -----------------------------------------


def run_engine(model, requests: dict[str, tuple[list[int], SamplingParams]], steps: list[StepStats] | None = None):
    """Submit every request at once to a fresh engine over the real runner; each request's events."""
    runner = ModelRunner(model, prefill_chunk=CHUNK, indexer_tile=TILE)
    events: dict[str, list[Event]] = {rid: [] for rid in requests}
    loop = EngineLoop(runner, SchedulerConfig(prefill_chunk=CHUNK, max_num_seqs=8),
                      lambda rid, event: events[rid].append(event))
    if steps is not None:
        loop.subscribe(steps.append)
    for rid, (prompt, sampling) in requests.items():
        loop.submit(Request(rid, tuple(prompt), sampling))
    loop.run_until_idle()
    assert all(isinstance(evs[-1], Done) for evs in events.values()), events
    return {rid: [e for e in evs if isinstance(e, Token)] for rid, evs in events.items()}


def assert_steps_mixed(steps: list[StepStats]) -> None:
    """The together-run really batched: a step with several decodes and a prefill chunk at once."""
    assert any(s.num_decode_tokens >= 2 and s.num_prefill_tokens > 0 for s in steps), steps


@row_invariant_blas
def test_greedy_tokens_and_logprobs_equal_each_request_alone(model_dir):
    model = load_model(model_dir, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    requests = {rid: (tokens, greedy) for rid, tokens in prompts(model.cfg.vocab_size).items()}
    alone = {rid: run_engine(model, {rid: request})[rid] for rid, request in requests.items()}
    steps: list[StepStats] = []
    together = run_engine(model, requests, steps)
    assert_steps_mixed(steps)
    for rid in requests:
        assert len(alone[rid]) == 6
        assert together[rid] == alone[rid], f"request {rid!r}: batched tokens/logprobs differ from alone"
    assert len({tuple(t.token_id for t in tokens) for tokens in alone.values()}) > 1  # not one constant output


@row_invariant_blas
def test_seeded_sampling_is_honoured_alone_and_among_others(model_dir):
    model = load_model(model_dir, dtype="float32")
    seqs = prompts(model.cfg.vocab_size)

    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)

    def ids(tokens: list[Token]) -> list[int]:
        return [t.token_id for t in tokens]

    alone = ids(run_engine(model, {"x": (seqs["b"], seeded(7))})["x"])
    again = ids(run_engine(model, {"x": (seqs["b"], seeded(7))})["x"])
    steps: list[StepStats] = []
    crowd = run_engine(model, {
        "a": (seqs["a"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
        "x": (seqs["b"], seeded(7)),
        "twin": (seqs["b"], seeded(7)),
        "other-seed": (seqs["b"], seeded(8)),
        "c": (seqs["c"], seeded(7)),
        "d": (seqs["d"], seeded(123)),
    }, steps)
    assert_steps_mixed(steps)
    assert again == alone, "the same seed drew different tokens in two runs alone"
    assert ids(crowd["x"]) == alone, "the same seed drew different tokens among other requests"
    assert ids(crowd["twin"]) == alone
    assert ids(crowd["other-seed"]) != alone, "a different seed drew the same 8 tokens"
    assert len(set(alone)) > 1  # a real draw, not a constant
