"""Decode overlap (engine/serving/decode_overlap.py): the runner queues the next decode step before it reads
this one's tokens. What a user must not notice: any difference in the tokens, logprobs or finish reasons,
whether requests finish at different steps, arrive late, are aborted, sample with seeds or penalties, wait
for min_tokens, follow a grammar, use the prefix cache, or the queued step fails to build. What must happen:
steps are queued ahead and taken.

On a GPU one thing differs, by design: when a request finishes, the queued step is taken with the finished
request's row still in it (its result unread), so the others' next token is computed in a batch one row
larger than the step one at a time would run, and a GPU row's bits depend on the batch's row count (the CPU's
do not with MLX's bundled BLAS; under `make test`'s OpenBLAS they can, so these tests rerun without it:
tests/equivalence/row_invariant_blas.py). The H200 gave the same tokens with a logprob 8.5·10⁻⁴ apart (docs/BENCHMARKS.md, "Session 11 on
the H200"); undoing the queued step instead would cost a step of device time per finish. So the tests that
finish requests compare with `same_streams`: exact on the CPU, tokens exact and logprobs within 10⁻³
relative on CUDA."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from tessera.engine.model.loader import load_model
from tessera.engine.serving.engine_loop import EngineLoop
from tessera.engine.serving.protocol import Done, Token, SamplingParams
from tessera.engine.serving.request import Request
from tessera.engine.serving.runner import ModelRunner
from tessera.engine.serving.scheduler import SchedulerConfig
from tessera.engine.tools.make_model import make_model
from tessera.engine.tools.replay import random_tokens
from tessera.kernels.cuda import on_cuda
from tests.equivalence.row_invariant_blas import row_invariant_blas

CHUNK, TILE = 64, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_model(tmp_path_factory.mktemp("overlap"), "tiny", seed=3, with_tokenizer=False),
                      dtype="float32")


class Driver:
    """A ModelRunner behind the real scheduler and engine loop, stepped on this thread."""

    def __init__(self, model, overlap: bool, prefix_cache_bytes: int = 0) -> None:
        self.runner = ModelRunner(model, CHUNK, TILE, prefix_cache_bytes=prefix_cache_bytes, decode_overlap=overlap)
        config = SchedulerConfig(prefill_chunk=CHUNK, max_num_seqs=4, prefix_cache_bytes=prefix_cache_bytes)
        self.events: dict[str, list] = {}
        self.requests: dict[str, Request] = {}
        self.loop = EngineLoop(self.runner, config, lambda rid, event: self.events.setdefault(rid, []).append(event))
        self.published: list = []  # every StepStats
        self.loop.subscribe(self.published.append)

    def submit(self, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
        self.requests[rid] = Request(rid, tuple(prompt), sampling)
        self.loop.submit(self.requests[rid])

    def steps(self, n: int | None = None) -> None:
        self.loop.run_until_idle(n)


def both_ways(model, drive, **driver_options) -> tuple[Driver, Driver]:
    """`drive(driver)` on a runner without the overlap, then on one with it: (one step at a time, overlapped)."""
    runs = []
    for overlap in (False, True):
        d = Driver(model, overlap, **driver_options)
        drive(d)
        runs.append(d)
    return runs[0], runs[1]


def same_streams(got: dict[str, list], want: dict[str, list]) -> bool:
    """Events equal; on CUDA, logprobs within 10⁻³ relative (the module docstring says why)."""
    if not on_cuda():
        return got == want

    def split(events):  # (everything but the logprobs, the logprobs)
        shapes, logprobs = [], []
        for e in events:
            if isinstance(e, Token):
                shapes.append(("token", e.token_id, tuple(t for t, _ in e.top_logprobs)))
                logprobs += [e.logprob or 0.0] + [lp for _, lp in e.top_logprobs]
            else:
                shapes.append(e)
        return shapes, logprobs

    for rid in set(got) | set(want):
        (got_shapes, got_lp), (want_shapes, want_lp) = split(got.get(rid, [])), split(want.get(rid, []))
        if got_shapes != want_shapes or any(abs(a - b) > 1e-3 * max(1.0, abs(b)) for a, b in zip(got_lp, want_lp)):
            return False
    return True


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True, **more)


def seeded(max_tokens: int, seed: int, **more) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=max_tokens, logprobs=2, ignore_eos=True,
                          **more)


def scenario(model, overlap: bool) -> Driver:
    """Four requests finishing at different steps, one arriving while the others decode, one aborted."""
    vocab = model.cfg.vocab_size
    d = Driver(model, overlap)
    d.submit("short", random_tokens(vocab, 20, 1), greedy(3))
    d.submit("long", random_tokens(vocab, 37, 2), greedy(14))
    d.submit("seeded", random_tokens(vocab, 9, 3), seeded(11, seed=7))
    d.submit("aborted", random_tokens(vocab, 15, 4), seeded(30, seed=8))
    d.steps(6)
    d.submit("late", random_tokens(vocab, 70, 5), seeded(6, seed=9))  # two prefill chunks while the rest decode
    d.steps(3)
    d.loop.abort("aborted")
    d.steps()
    return d


@row_invariant_blas
def test_overlapped_decode_streams_the_same_tokens_logprobs_and_endings(model):
    one_by_one, overlapped = scenario(model, overlap=False), scenario(model, overlap=True)
    published = [e for s in overlapped.published for e in s.overlap_events]

    assert same_streams(overlapped.events, one_by_one.events)
    assert [e.finish_reason for e in overlapped.events["aborted"] if isinstance(e, Done)] == ["abort"]
    assert len([e for e in overlapped.events["long"] if isinstance(e, Token)]) == 14
    counts = overlapped.runner.overlap_counts
    assert counts.taken >= 6  # steps with the same decodes as the last (or fewer: finishes, the abort) were taken...
    assert counts.undone >= 1  # ...and the arrival's prefill chunk undid one
    assert counts.queued == counts.taken + counts.undone + (1 if overlapped.runner._queued else 0)
    assert one_by_one.runner.overlap_counts.queued == 0
    # every event reaches the step statistics (tessera_decode_overlap_steps_total)
    assert {e: published.count(e) for e in ("queued", "taken", "undone")} == {
        "queued": counts.queued, "taken": counts.taken, "undone": counts.undone}
    assert not [e for s in one_by_one.published for e in s.overlap_events]


@row_invariant_blas
def test_requests_that_finish_or_are_aborted_leave_the_queued_step_to_the_others(model):
    vocab = model.cfg.vocab_size

    def drive(d: Driver) -> None:
        d.submit("a", random_tokens(vocab, 10, 1), greedy(3))
        d.submit("b", random_tokens(vocab, 12, 2), seeded(12, seed=5))
        d.submit("c", random_tokens(vocab, 14, 3), greedy(6))
        d.submit("x", random_tokens(vocab, 16, 4), seeded(40, seed=6))
        d.steps(7)  # four prefill steps, then decodes only
        d.loop.abort("x")
        d.steps()

    one_by_one, overlapped = both_ways(model, drive)
    assert same_streams(overlapped.events, one_by_one.events)
    assert [type(e).__name__ for e in overlapped.events["x"]][-1] == "Done"
    counts = overlapped.runner.overlap_counts
    # a, c and x leave while others decode: each time the queued step is taken for the rest. Only the plan
    # after the last request ends (nothing left to decode) drops one.
    assert counts.undone == 1
    assert counts.taken >= 8


@row_invariant_blas
def test_penalized_requests_are_queued_ahead_and_stream_the_same_tokens(model):
    """The queued step samples before its fed tokens reach the histories: the sampler counts them on the
    device (sampler.sample_lazily's `pending`); the penalties must come out as one step at a time."""
    vocab = model.cfg.vocab_size
    runs = {}
    for overlap, penalized in ((False, True), (True, True), (True, False)):
        d = Driver(model, overlap)
        more = dict(repetition_penalty=1.6, frequency_penalty=1.2, presence_penalty=0.8) if penalized else {}
        d.submit("a", random_tokens(vocab, 12, 1), greedy(16, **more))
        d.submit("b", random_tokens(vocab, 9, 2), seeded(14, seed=4, **more))
        d.submit("c", random_tokens(vocab, 20, 3), greedy(12, **({"frequency_penalty": -1.5} if penalized else {})))
        d.steps()
        runs[overlap, penalized] = d
    assert same_streams(runs[True, True].events, runs[False, True].events)
    assert runs[True, True].events != runs[True, False].events  # the penalties change the tokens: they count
    assert runs[True, True].runner.overlap_counts.taken >= 10


class _AllowAllBut:
    """A TokenConstraint stand-in (protocol.TokenConstraint): every token but `banned`."""

    def __init__(self, vocab: int, banned: set[int]) -> None:
        bits = [0 if t in banned else 1 for t in range(vocab)]
        self._mask = bytes(sum(bits[b * 8 + i] << i for i in range(8) if b * 8 + i < vocab)
                           for b in range((vocab + 7) // 8))
        self.accepted: list[int] = []

    def allowed_mask(self) -> bytes:
        return self._mask

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


@row_invariant_blas
def test_a_step_with_a_grammar_runs_one_step_at_a_time_with_the_same_tokens(model):
    vocab = model.cfg.vocab_size

    def drive(d: Driver) -> None:
        d.submit("free", random_tokens(vocab, 12, 1), greedy(10))
        d.submit("json", random_tokens(vocab, 9, 2),
                 greedy(10, constraint=_AllowAllBut(vocab, set(range(0, vocab, 3)))))
        d.steps()

    one_by_one, overlapped = both_ways(model, drive)
    assert same_streams(overlapped.events, one_by_one.events)
    assert overlapped.runner.overlap_counts.queued == 0  # "json" decodes in every step: never ahead
    tokens = [e.token_id for e in overlapped.events["json"] if isinstance(e, Token)]
    assert tokens and all(t % 3 for t in tokens)


@row_invariant_blas
def test_min_tokens_is_enforced_on_steps_queued_ahead(model):
    vocab = model.cfg.vocab_size
    stop = tuple(range(vocab))[::8]  # an eighth of the vocabulary stops the request, but not before 6 tokens

    def drive(d: Driver) -> None:
        d.submit("r", random_tokens(vocab, 12, 1),
                 SamplingParams(temperature=1.0, seed=3, max_tokens=20, min_tokens=6, stop_token_ids=stop))
        d.steps()

    one_by_one, overlapped = both_ways(model, drive)
    tokens = [e.token_id for e in overlapped.events["r"] if isinstance(e, Token)]
    (done,) = [e for e in overlapped.events["r"] if isinstance(e, Done)]
    assert same_streams(overlapped.events, one_by_one.events)
    assert len(tokens) >= 6 and not set(tokens) & set(stop)
    # every decode step (tokens 2 .. n) queued the next; the one after the stop token was dropped
    assert overlapped.runner.overlap_counts.queued == done.num_generated_tokens - 1
    assert overlapped.runner.overlap_counts.undone == 1


def test_a_queued_step_that_fails_to_build_falls_back_to_the_planned_step(model, caplog):
    vocab = model.cfg.vocab_size
    one_by_one = Driver(model, overlap=False)  # the same batches (a GPU's bits depend on the batch)
    one_by_one.submit("long", random_tokens(vocab, 37, 2), greedy(14))
    one_by_one.steps()
    d = Driver(model, overlap=True)
    real_forward = d.runner.model.forward

    def refuse_device_tokens(*args, **kwargs):
        if kwargs.get("device_token_ids") is not None:
            real_forward(*args, **kwargs)  # writes its caches, then fails: the undo must take them back
            raise RuntimeError("injected")
        return real_forward(*args, **kwargs)

    d.runner.model.forward = refuse_device_tokens
    try:
        with caplog.at_level(logging.ERROR):
            d.submit("long", random_tokens(vocab, 37, 2), greedy(14))
            d.steps()
    finally:
        d.runner.model.forward = real_forward
    assert d.events["long"] == one_by_one.events["long"]
    assert d.runner.overlap_counts.failed >= 10 and d.runner.overlap_counts.queued == 0
    assert "queueing the next decode step ahead failed" in caplog.text


@row_invariant_blas
def test_a_decode_that_crosses_a_block_is_cached_and_restored_as_without_overlap(model):
    vocab = model.cfg.vocab_size
    turn1 = random_tokens(vocab, 100, 11)

    def drive(d: Driver) -> None:
        d.submit("turn1", turn1, greedy(40))  # 100 + 40 tokens: the decode crosses the 128-token block
        d.steps()
        reply = [e.token_id for e in d.events["turn1"] if isinstance(e, Token)]
        d.submit("turn2", turn1 + reply + random_tokens(vocab, 5, 12), greedy(5))
        d.steps()

    one_by_one, overlapped = both_ways(model, drive, prefix_cache_bytes=64 << 20)
    assert same_streams(overlapped.events, one_by_one.events)
    assert overlapped.requests["turn2"].num_cached_tokens == 128  # the block the decode filled, restored
    assert overlapped.runner.overlap_counts.taken > 20


def test_a_decode_planned_at_another_position_than_its_cache_is_refused_and_changes_nothing(model):
    from tessera.engine.serving.protocol import DecodeSlot, NewRequest, PrefillChunk, StepPlan

    runner = ModelRunner(model, CHUNK, TILE)
    prompt = tuple(random_tokens(model.cfg.vocab_size, 20, 1))
    sampling = greedy(10)
    plan = StepPlan(prefill=PrefillChunk("r", prompt, 0, True), new_requests=(NewRequest("r", prompt, sampling),))
    first = runner.execute(plan)
    token = first.sampled[0].token_id
    with pytest.raises(RuntimeError, match="position 21, its cache holds 20"):
        runner.execute(StepPlan(decodes=(DecodeSlot("r", token, 21),)))
    assert runner.execute(StepPlan(decodes=(DecodeSlot("r", token, 20),))).sampled  # still at 20: runs


def test_a_queued_steps_logits_come_joined_with_the_split_rows_bits(model):
    """The queued step asks the model for its batch's logits as one [B, vocab] array (forward's `joined`: no
    split the sampler would concatenate again, a copy kernel a row): the same rows, bit for bit, as the
    per-segment logits of the same step on twin caches; and a joined call refuses all_logits, leaving the cache
    as it was."""
    from tessera.engine.model.deepseek_v4 import Segment

    caches, twins = [], []
    for seed in range(3):
        for group in (caches, twins):
            cache = model.new_cache()
            model.forward([Segment(cache, random_tokens(model.cfg.vocab_size, 12 + seed, seed))], tile=TILE)
            group.append(cache)
    (joined,) = model.forward([Segment(c, [5 + i]) for i, c in enumerate(caches)], tile=TILE, joined=True)
    split = model.forward([Segment(c, [5 + i]) for i, c in enumerate(twins)], tile=TILE)
    assert joined.shape == (3, model.cfg.vocab_size) and len(split) == 3
    assert (joined == mx.concatenate(split)).all().item()
    before = caches[0].num_tokens
    with pytest.raises(ValueError, match="all_logits"):
        model.forward([Segment(caches[0], [1])], joined=True, all_logits=True)
    assert caches[0].num_tokens == before  # refused before the step touched the cache
