"""The sampler on hand-made logits: greedy, seeds, truncation, penalties, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.serving.protocol import SamplingParams
from tessera.engine.serving.sampler import RequestRng, TokenHistory, process_logits, ranked_logprobs, sample, token_logprobs

PROBS = [0.5, 0.3, 0.1, 0.05, 0.05]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def draw_many(logits_row, params: SamplingParams, num_draws: int = 2000) -> Counter:
    """One row repeated num_draws times, each with its own seed: the empirical distribution of one step."""
    logits = mx.broadcast_to(mx.array(logits_row, dtype=mx.float32), (num_draws, len(logits_row)))
    histories = [TokenHistory([0]) for _ in range(num_draws)]
    rngs = [RequestRng(seed) for seed in range(num_draws)]
    return Counter(s.token_id for s in sample(logits, [params] * num_draws, histories, rngs))


def generate(logit_rows: list[np.ndarray], row_index: int, params: list[SamplingParams], seeds: list[int]):
    """Sample step after step with fixed batch rows; return the tokens of row `row_index`."""
    histories = [TokenHistory([1, 2, 3]) for _ in params]
    rngs = [RequestRng(seed) for seed in seeds]
    tokens = []
    for step_logits in logit_rows:
        samples = sample(mx.array(step_logits), params, histories, rngs)
        for history, s in zip(histories, samples):
            history.append(s.token_id)
        tokens.append(samples[row_index].token_id)
    return tokens


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(4, 1000)).astype(np.float32)
    params = [SamplingParams(temperature=0.0)] * 4
    samples = sample(mx.array(logits), params, [TokenHistory([0]) for _ in range(4)], [RequestRng(0)] * 4)
    assert [s.token_id for s in samples] == list(np.argmax(logits, axis=1))


def test_same_seed_same_tokens_whatever_the_batch_neighbours():
    rng = np.random.default_rng(1)
    num_steps, vocab = 12, 500
    mine = rng.normal(size=(num_steps, vocab)).astype(np.float32) * 3
    params = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, seed=42)

    alone = generate([mine[i][None] for i in range(num_steps)], 0, [params], [42])
    neighbours = rng.normal(size=(num_steps, 2, vocab)).astype(np.float32)
    batched_rows = [np.stack([neighbours[i, 0], mine[i], neighbours[i, 1]]) for i in range(num_steps)]
    batch_params = [SamplingParams(temperature=1.3, seed=7), params, SamplingParams(temperature=0.0)]
    batched = generate(batched_rows, 1, batch_params, [7, 42, 123])

    assert alone == batched
    other_seed = generate([mine[i][None] for i in range(num_steps)], 0, [params], [43])
    assert other_seed != alone  # 12 draws from ~100 tokens: a collision would be a broken seed


def test_sampling_follows_the_distribution():
    counts = draw_many(np.log(PROBS), SamplingParams(temperature=1.0), num_draws=4000)
    for token_id, p in enumerate(PROBS):
        assert abs(counts[token_id] / 4000 - p) < 0.03


def test_top_k_restricts_support():
    logits = np.random.default_rng(2).normal(size=50).astype(np.float32)
    counts = draw_many(logits, SamplingParams(temperature=2.0, top_k=5))
    assert set(counts) == set(np.argsort(-logits)[:5].tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Mass before token 1 is 0.5 < 0.7: kept. Mass before token 2 is 0.8: cut.
    counts = draw_many(np.log(PROBS), SamplingParams(top_p=0.7))
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04  # renormalized over what is kept


def test_min_p_cuts_below_a_fraction_of_the_top_probability():
    counts = draw_many(np.log(PROBS), SamplingParams(min_p=0.15))  # keeps p >= 0.075
    assert set(counts) == {0, 1, 2}


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    history = TokenHistory([1])
    for token_id in (2, 2, 3):
        history.append(token_id)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0)
    processed = process_logits(mx.zeros(6), params, history)
    np.testing.assert_allclose(np.array(processed), [0, 0, -2.0, -1.5, 0, 0])


def test_repetition_penalty_covers_prompt_and_output_and_respects_sign():
    history = TokenHistory([0, 1])
    history.append(2)
    processed = process_logits(
        mx.array([1.0, -1.0, 2.0, -2.0, 0.5]), SamplingParams(temperature=0.0, repetition_penalty=2.0), history
    )
    np.testing.assert_allclose(np.array(processed), [0.5, -2.0, 1.0, -2.0, 0.5])


def test_logit_bias_moves_the_choice():
    logits = mx.array([[5.0, 1.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0, logit_bias=((0, -100.0), (3, 2.0)))
    assert sample(logits, [greedy], [TokenHistory([0])], [RequestRng(0)])[0].token_id == 3
    counts = draw_many([0.0] * 4, SamplingParams(logit_bias=((2, 100.0),)), num_draws=200)
    assert counts == Counter({2: 200})


def test_logit_bias_outside_the_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        process_logits(mx.zeros(4), SamplingParams(logit_bias=((4, 1.0),)), TokenHistory([0]))


def test_penalty_shows_in_the_sampled_distribution():
    history = TokenHistory([9])
    for _ in range(3):
        history.append(0)
    params = SamplingParams(frequency_penalty=1.0)  # token 0 was generated 3 times: its logit drops by 3
    logits = mx.broadcast_to(mx.zeros(4), (1000, 4))
    samples = sample(logits, [params] * 1000, [history] * 1000, [RequestRng(s) for s in range(1000)])
    expected = math.exp(-3) / (math.exp(-3) + 3)
    assert abs(sum(s.token_id == 0 for s in samples) / 1000 - expected) < 0.02


def test_logprobs_are_log_softmax_and_top_n_is_sorted():
    logits = np.random.default_rng(3).normal(size=(1, 200)).astype(np.float32) * 2
    params = SamplingParams(temperature=1.0, logprobs=5, seed=0)
    s = sample(mx.array(logits), [params], [TokenHistory([0])], [RequestRng(0)])[0]
    expected = log_softmax(logits[0].astype(np.float64))
    assert s.logprob == pytest.approx(expected[s.token_id], abs=1e-5)
    top_ids = [token_id for token_id, _ in s.top_logprobs]
    assert top_ids == list(np.argsort(-expected)[:5])
    values = [value for _, value in s.top_logprobs]
    assert values == sorted(values, reverse=True)
    np.testing.assert_allclose(values, expected[top_ids], atol=1e-5)


def test_logprobs_are_of_the_processed_distribution():
    logits = np.log(np.array(PROBS, dtype=np.float32))[None]
    # Temperature 0.5 sharpens; top_k=3 cuts two tokens to -inf; the chosen token is always among the top 3.
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=5)
    s = sample(mx.array(logits), [params], [TokenHistory([0])], [RequestRng(1)])[0]
    expected = log_softmax(np.log(np.array(PROBS[:3])) / 0.5)
    np.testing.assert_allclose([v for _, v in s.top_logprobs[:3]], expected, atol=1e-5)
    assert [v for _, v in s.top_logprobs[3:]] == [-math.inf, -math.inf]
    assert s.token_id in (0, 1, 2) and s.logprob == pytest.approx(expected[s.token_id], abs=1e-5)


def test_greedy_logprobs_are_untempered_and_zero_top_n_means_chosen_only():
    logits = np.array([[1.0, 3.0, 2.0]], dtype=np.float32)
    params = SamplingParams(temperature=0.0, logprobs=0)
    s = sample(mx.array(logits), [params], [TokenHistory([0])], [RequestRng(0)])[0]
    assert s.token_id == 1 and s.top_logprobs == ()
    assert s.logprob == pytest.approx(log_softmax(logits[0].astype(np.float64))[1], abs=1e-6)


def test_negative_seeds_are_valid_and_distinct():
    assert generate([np.zeros((1, 1000), np.float32)] * 4, 0, [SamplingParams()], [-1]) != generate(
        [np.zeros((1, 1000), np.float32)] * 4, 0, [SamplingParams()], [1]
    )


def test_no_logprobs_unless_asked():
    s = sample(mx.zeros((1, 4)), [SamplingParams()], [TokenHistory([0])], [RequestRng(0)])[0]
    assert s.logprob is None and s.top_logprobs == ()


# ---- allowed-token masks (structured outputs) and min_tokens ---------------------------------------------


def _mask(allowed: list[int], vocab: int) -> bytes:
    bits = np.zeros((vocab + 31) // 32 * 32, dtype=bool)
    bits[allowed] = True
    return np.packbits(bits, bitorder="little").tobytes()


def test_a_mask_limits_greedy_and_random_draws_to_the_allowed_tokens():
    row = np.log(np.array(PROBS * 8, dtype=np.float32))  # [40]: token i has probability PROBS[i % 5]
    allowed = [3, 17, 33]  # probabilities 0.05, 0.1, 0.05: 17 is the best allowed, token 0 the best overall
    greedy = sample(mx.array(row)[None, :], [SamplingParams(temperature=0.0, logprobs=2)], [TokenHistory([0])],
                    [RequestRng(0)], [_mask(allowed, 40)])[0]
    assert greedy.token_id == 17
    assert {t for t, _ in greedy.top_logprobs} <= set(allowed)  # logprobs of the distribution drawn from
    logits = mx.broadcast_to(mx.array(row), (500, 40))
    draws = sample(logits, [SamplingParams(temperature=1.0)] * 500, [TokenHistory([0]) for _ in range(500)],
                   [RequestRng(seed) for seed in range(500)], [_mask(allowed, 40)] * 500)
    counts = Counter(d.token_id for d in draws)
    assert set(counts) == set(allowed) and counts[17] > counts[3]


def test_min_tokens_masks_stop_tokens_until_reached():
    row = np.array([10.0, 0.0, 0.0, 0.0], dtype=np.float32)  # token 0 (the stop token) dominates
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(0,))
    history = TokenHistory([1])
    chosen = []
    for _ in range(3):
        token = sample(mx.array(row)[None, :], [params], [history], [RequestRng(0)])[0].token_id
        history.append(token)
        chosen.append(token)
    assert chosen[:2] != [0, 0] and 0 not in chosen[:2] and chosen[2] == 0


def test_a_grammar_that_can_only_end_wins_over_min_tokens():
    row = np.zeros(4, dtype=np.float32)
    params = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(0,))
    token = sample(mx.array(row)[None, :], [params], [TokenHistory([1])], [RequestRng(0)], [_mask([0], 4)])[0]
    assert token.token_id == 0


def test_token_logprobs_gathers_only_the_reported_values_on_the_device():
    """Prompt and sampled logprobs copy [n] and [n, k] to the host, never the [n, V] block."""
    logits = mx.random.normal((3, 50), key=mx.random.key(7))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen, top_ids, top_values = token_logprobs(logprobs, mx.array([4, 0, 49]), 5)
    assert chosen.shape == (3,) and top_ids.shape == (3, 5) and top_values.shape == (3, 5)
    full = np.array(logprobs)
    for row, (token, (logprob, top)) in enumerate(zip([4, 0, 49], ranked_logprobs(chosen, top_ids, top_values))):
        assert logprob == full[row, token]
        want = sorted(range(50), key=lambda i: (-full[row, i], i))[:5]
        assert top == tuple((i, float(full[row, i])) for i in want)


# ---- a pending token (engine/serving/decode_overlap.py): counted as if it were in the history ------------


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32).view(mx.uint32))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.8, frequency_penalty=0.9, presence_penalty=0.4),
    SamplingParams(temperature=0.0, frequency_penalty=-1.3, presence_penalty=-0.7, repetition_penalty=0.8,
                   logit_bias=((5, 2.5),)),
])
@pytest.mark.parametrize("pending_id", [7, 3, 11])  # 7: generated twice already; 3: in the prompt only; 11: new
def test_a_pending_token_penalizes_as_once_appended_bit_for_bit(params, pending_id):
    rng = np.random.default_rng(pending_id)
    row = rng.standard_normal(16).astype(np.float32)
    row[[2, 7, 12]] = [-0.0, 0.0, -0.0]  # signed zeros, seen and unseen: an untouched logit keeps its sign
    history = TokenHistory([1, 2, 3, 3])
    for token_id in (7, 9, 7):
        history.append(token_id)
    pending = process_logits(mx.array(row), params, history, mx.array(pending_id, dtype=mx.int32))
    history.append(pending_id)
    appended = process_logits(mx.array(row), params, history)
    assert np.array_equal(_bits(pending), _bits(appended))


def test_a_pending_token_counts_towards_min_tokens_and_draws_the_same_tokens():
    stop = tuple(range(0, 32, 2))
    params = [SamplingParams(temperature=1.0, seed=s, min_tokens=4, stop_token_ids=stop, frequency_penalty=0.5)
              for s in range(6)]
    logits = mx.array(np.random.default_rng(0).standard_normal((6, 32)).astype(np.float32) * 3)
    pending = mx.array([5, 4, 7, 9, 2, 11], dtype=mx.int32)
    histories, appended = [], []
    for i in range(6):  # 2 outputs so far: with the pending one, the step samples output 4 (stops still masked)...
        a, b = TokenHistory([1]), TokenHistory([1])
        for t in range(2 + i % 2):  # ...or output 5 (min_tokens reached: stops allowed)
            a.append(20 + t)
            b.append(20 + t)
        b.append(int(pending[i].item()))
        histories.append(a)
        appended.append(b)
    from tessera.engine.serving.sampler import read_samples, sample_lazily

    ahead = read_samples(sample_lazily(logits, params, histories, [RequestRng(p.seed) for p in params], pending=pending))
    after = sample(logits, params, appended, [RequestRng(p.seed) for p in params])
    assert ahead == after
    assert not {s.token_id for s in ahead[0::2]} & set(stop)  # output 4 of 4 minimum: no stop token


def _chosen_alone(logits_row: mx.array, params: SamplingParams, history: TokenHistory, rng: RequestRng):
    """The per-row path every non-plain row takes (`_choose` after `restrict`), evaluated."""
    from tessera.engine.serving.sampler import _choose, restrict

    row = _choose(restrict(logits_row.astype(mx.float32), params, history, None), params, history, rng)
    mx.eval([a for a in row if a is not None])
    return [None if a is None else np.array(a) for a in row]


@pytest.mark.parametrize("logprobs", [None, 0, 3])
def test_plain_greedy_rows_chosen_together_give_each_row_alone_bit_for_bit(logprobs):
    """Greedy rows that nothing adjusts are chosen as one block (sampler._greedy_rows); the others, beside them
    in the same batch, one by one. Every row equals the per-row path on that row alone: token (ties to the
    lowest id), its logprob and the top-n, to the bit."""
    from tessera.engine.serving.sampler import sample_lazily

    vocab, rows = 300, 9
    logits = mx.random.normal((rows, vocab), key=mx.random.key(3)) * 4
    logits = logits.at[2, 17].add(50.0).at[2, 40].add(50.0 + float(logits[2, 17] - logits[2, 40]))  # a tie
    greedy = SamplingParams(temperature=0.0, logprobs=logprobs)
    params = [greedy] * rows
    params[4] = SamplingParams(temperature=0.0, logprobs=logprobs, presence_penalty=1.5)  # adjusted: alone
    params[6] = SamplingParams(temperature=0.8, seed=5, logprobs=logprobs)  # random: alone
    params[7] = SamplingParams(temperature=0.0, logprobs=None if logprobs else 2)  # another block
    histories = [TokenHistory([1, 2]) for _ in range(rows)]
    for h in histories:
        h.append(int(mx.argmax(logits[4]).item()))  # the penalty has something to act on
    got = sample_lazily(logits, params, histories, [RequestRng(9) for _ in range(rows)])
    mx.eval(got.arrays())
    for i in range(rows):
        want = _chosen_alone(logits[i], params[i], histories[i], RequestRng(9))
        have = [None if a is None else np.array(a) for a in got.rows[i]]
        assert [None if a is None else a.shape for a in have] == [None if a is None else a.shape for a in want], i
        assert all(a is None and b is None or np.array_equal(a, b) for a, b in zip(have, want)), i
    assert int(np.array(got.rows[2][0])[0]) == 17  # the tie went to the lower id
    assert got.tokens.dtype == mx.int32 and got.tokens.tolist() == [int(np.array(r[0])[0]) for r in got.rows]


# Views: no kernel on a GPU (each row's [1, ...] piece of the block is a Slice or a Split output).
VIEW_KINDS = {"Slice", "Split", "Squeeze", "Reshape", "ExpandDims", "Broadcast", "BroadcastAxes"}


def test_a_batch_of_plain_greedy_rows_launches_a_fixed_number_of_kernels(tmp_path):
    """Sampling 16 plain greedy rows builds as many non-view graph nodes as sampling 4 (one argmax, and one
    log-sum-exp, top-n and gathers with logprobs), not a few per row."""
    from tessera.engine.serving.sampler import sample_lazily
    from tests.support.graph_nodes import primitive_kinds

    def nodes(rows: int, logprobs: int | None) -> int:
        logits = mx.random.normal((rows, 500), key=mx.random.key(rows))
        mx.eval(logits)
        params = [SamplingParams(temperature=0.0, logprobs=logprobs)] * rows
        got = sample_lazily(logits, params, [TokenHistory([1]) for _ in range(rows)], [RequestRng(1) for _ in range(rows)])
        kinds = primitive_kinds(got.arrays(), tmp_path / "sample.dot")
        return sum(v for k, v in kinds.items() if k not in VIEW_KINDS)

    for logprobs in (None, 2):
        assert nodes(16, logprobs) == nodes(4, logprobs) > 0, logprobs


def test_a_greedy_batchs_tokens_for_the_next_step_are_its_argmax_not_the_rows_joined_again(tmp_path):
    """The overlapped decode step is fed the batch's tokens as one device array (`LazySamples.tokens`). For
    plain greedy rows that is the block's argmax itself: a concatenation of the rows' [1] pieces would be a
    copy kernel a row on a GPU. Its values are the rows' tokens, in order, also for a subset of the rows."""
    from tessera.engine.serving.sampler import sample_lazily
    from tests.support.graph_nodes import primitive_kinds

    rows = 16
    logits = mx.random.normal((rows, 500), key=mx.random.key(4))
    mx.eval(logits)
    params = [SamplingParams(temperature=0.0)] * rows
    got = sample_lazily(logits, params, [TokenHistory([1]) for _ in range(rows)], [RequestRng(1) for _ in range(rows)])
    assert "Concatenate" not in primitive_kinds(got.tokens, tmp_path / "tokens.dot")
    assert got.tokens.dtype == mx.int32
    assert got.tokens.tolist() == np.argmax(np.array(logits), axis=-1).tolist()
    picks = [3, 0, 9]
    assert got.subset(picks).tokens.tolist() == [got.tokens.tolist()[i] for i in picks]
    assert got.subset(range(rows)) is got
