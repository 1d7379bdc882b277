"""Next-token sampling on MLX: logits [B, V] -> one token per row, each row under its own SamplingParams.

Pipeline per row, in vLLM v1's order:
  allowed-token mask (structured outputs) -> min_tokens (stop tokens masked)                   (`restrict`)
  logit_bias -> repetition penalty -> frequency and presence penalties   (`penalize`: can change the argmax)
  greedy: argmax;  else temperature -> min_p -> top_k -> top_p -> draw   (`warp`)

Penalty semantics:
  repetition_penalty r (HF / vLLM), over prompt + generated tokens: a seen token's logit l becomes l / r if
    l > 0, else l * r.
  frequency_penalty f, presence_penalty p (OpenAI), over generated tokens only: l -= f * count + p * (count > 0).

Logprobs are taken from the *processed* distribution, the one the token is drawn from (vLLM's
`logprobs_mode="processed_logprobs"`, and vLLM V0's behaviour): after bias, penalties, temperature and
truncation, so tokens cut by top_k / top_p / min_p have logprob -inf (an HTTP layer may clamp it, as vLLM
does to -9999.0). Greedy rows use the penalized logits at temperature 1, untruncated.

Seeds: each request owns a `RequestRng` (an `mx.random.key`, split once per drawn token), and every row is
processed on its own, so a row's token depends only on its logits, its history and its key, never on which
other requests share the batch (or whether it is batched at all).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from tessera.engine.serving.protocol import SamplingParams

_GREEDY_TEMPERATURE = 1e-5  # vLLM's epsilon: temperatures below it sample greedily

# One row's lazy result: token [1], then (if logprobs were asked) its logprob [1], top ids [1, n], their logprobs.
LazyRow = tuple[mx.array, "mx.array | None", "mx.array | None", "mx.array | None"]


@dataclass(frozen=True)
class LazySamples:
    """A batch's sampled rows before anything is evaluated, and their tokens as one array: what the next
    decode step is fed while they are still on the device (engine/serving/decode_overlap.py)."""

    rows: tuple[LazyRow, ...]
    tokens: mx.array  # [B] int32: row i's token. Plain greedy rows in order: their block's argmax itself,
    # not the rows concatenated again (on a GPU a concatenation is a copy kernel a row).

    def subset(self, picks: Sequence[int]) -> "LazySamples":
        """Rows `picks` of this batch, in that order."""
        if list(picks) == list(range(len(self.rows))):
            return self
        return LazySamples(tuple(self.rows[i] for i in picks), self.tokens[mx.array(picks, dtype=mx.int32)])

    def arrays(self) -> list[mx.array]:
        """Every array the rows and tokens hold (what evaluating them means)."""
        return [*row_arrays(self.rows), self.tokens]


@dataclass(frozen=True)
class Sample:
    """One row's result: the chosen token, its logprob and the top alternatives (descending) if asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class TokenHistory:
    """The tokens one request has seen, kept in the form the penalties need. Append every sampled token."""

    def __init__(self, prompt_ids: Sequence[int]):
        self._prompt_ids: np.ndarray | None = np.asarray(prompt_ids, dtype=np.int64)
        self._prompt_unique_ids: np.ndarray | None = None
        self._output_counts: dict[int, int] = {}

    def append(self, token_id: int) -> None:
        self._output_counts[token_id] = self._output_counts.get(token_id, 0) + 1

    @property
    def num_output_tokens(self) -> int:
        return sum(self._output_counts.values())

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, how often each was generated), for frequency / presence penalties."""
        ids = np.fromiter(self._output_counts.keys(), dtype=np.int64, count=len(self._output_counts))
        counts = np.fromiter(self._output_counts.values(), dtype=np.float32, count=len(self._output_counts))
        return ids, counts

    def seen_ids(self) -> np.ndarray:
        """Unique ids of prompt + generated tokens, for the repetition penalty."""
        if self._prompt_unique_ids is None:  # once, lazily: a 1M-token prompt is worth deduplicating only if used
            self._prompt_unique_ids = np.unique(self._prompt_ids)
            self._prompt_ids = None
        output_ids = np.fromiter(self._output_counts.keys(), dtype=np.int64, count=len(self._output_counts))
        return np.union1d(self._prompt_unique_ids, output_ids)


class RequestRng:
    """One request's random stream: `mx.random.key(seed)`, split once per drawn token."""

    def __init__(self, seed: int | None):
        # No seed: a fresh random one, so unseeded requests still never share a stream. OpenAI seeds may be
        # negative; mx.random.key takes a uint64.
        self._key = mx.random.key(secrets.randbits(64) if seed is None else seed % 2**64)

    def next_key(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key

    def position(self) -> mx.array:
        """Where the stream stands now; `rewind_to` it to draw the same keys again."""
        return self._key

    def rewind_to(self, position: mx.array) -> None:
        self._key = position


def sample(
    logits: mx.array,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    rngs: Sequence[RequestRng],
    masks: Sequence[bytes | None] | None = None,
) -> list[Sample]:
    """Choose one token per row of `logits` [B, V]. Does not append to the histories: the caller does, once the
    token is accepted. `masks[i]`: row i's allowed tokens (TokenConstraint.allowed_mask layout), None: all."""
    return read_samples(sample_lazily(logits, params, histories, rngs, masks))


def sample_lazily(
    logits: mx.array,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    rngs: Sequence[RequestRng],
    masks: Sequence[bytes | None] | None = None,
    pending: mx.array | None = None,
) -> LazySamples:
    """`sample`'s rows before anything is evaluated: the caller may queue them (`mx.async_eval`) and build
    more work on their tokens first (engine/serving/decode_overlap.py). Each row's random key is drawn now.
    `pending` [B]: each row's last token, sampled but still on the device (not in its history yet): the
    penalties and min_tokens count it as the history will once it is read."""
    num_rows = logits.shape[0]
    masks = masks if masks is not None else [None] * num_rows
    if not (len(params) == len(histories) == len(rngs) == len(masks) == num_rows):
        raise ValueError(
            f"{num_rows} logit rows but {len(params)} params, {len(histories)} histories, {len(rngs)} rngs, "
            f"{len(masks)} masks"
        )
    logits = logits.astype(mx.float32)
    extra = 0 if pending is None else 1
    rows: list[LazyRow | None] = [None] * num_rows
    plain: dict[int | None, list[int]] = {}  # logprobs asked -> the plain greedy rows asking it
    for i in range(num_rows):
        if _plain_greedy(params[i], histories[i], masks[i], extra):
            plain.setdefault(params[i].logprobs, []).append(i)
    block_tokens = None
    for num_top, members in plain.items():
        greedy, tokens = _greedy_rows(logits, members, num_top)
        for i, row in zip(members, greedy):
            rows[i] = row
        if len(members) == num_rows:
            block_tokens = tokens
    for i in range(num_rows):
        if rows[i] is None:
            token = None if pending is None else pending[i]
            row = restrict(logits[i], params[i], histories[i], masks[i], extra)
            rows[i] = _choose(row, params[i], histories[i], rngs[i], token)
    if block_tokens is None:
        block_tokens = mx.concatenate([row[0] for row in rows])
    return LazySamples(tuple(rows), block_tokens.astype(mx.int32))


def _plain_greedy(params: SamplingParams, history: TokenHistory, mask: bytes | None, num_pending: int) -> bool:
    """A greedy row whose logits nothing adjusts (no bias, penalty, grammar mask or pending min_tokens): its
    token is the argmax of the model's row itself, so such rows are chosen together (`_greedy_rows`)."""
    return (_is_greedy(params) and mask is None and not _holds_stop_tokens(params, history, num_pending)
            and not params.logit_bias and params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0)


def _greedy_rows(logits: mx.array, members: list[int], num_top: int | None) -> tuple[list[LazyRow], mx.array]:
    """`_choose` for plain greedy rows `members` of logits [B, V] asking `num_top` logprobs (None: none), as a
    few kernels for all of them instead of a few per row (each row keeps only views of the block's results):
    a batch-16 decode step's sampling launches 1 kernel instead of 16 (~8 instead of ~100 with logprobs).
    Each row's ops are the per-row path's on a [1, V] row of a [G, V] block: the same argmax and the same
    per-row log-sum-exp (tests/test_sampler.py compares them bit for bit; it passes on the CPU and on the H200,
    docs/BENCHMARKS.md "Session 14 on the H200"). -> (the rows, their tokens [G])."""
    block = logits if members == list(range(logits.shape[0])) else logits[mx.array(members)]  # [G, V]
    tokens = mx.argmax(block, axis=-1)  # [G]; ties: the lowest id
    if num_top is None:
        return [(token, None, None, None) for token in _each_row(tokens, len(members))], tokens
    logprobs = block - mx.logsumexp(block, axis=-1, keepdims=True)  # [G, V]
    chosen, top_ids, top_values = token_logprobs(logprobs, tokens, num_top)
    return list(zip(*(_each_row(a, len(members)) for a in (tokens, chosen, top_ids, top_values)))), tokens


def _each_row(a: mx.array | None, num_rows: int) -> list:
    """[G, ...] -> G arrays [1, ...] (one split node); None -> G Nones."""
    if a is None:
        return [None] * num_rows
    return [a] if num_rows == 1 else mx.split(a, num_rows)


def read_samples(samples: LazySamples) -> list[Sample]:
    """The rows' tokens (and logprobs) on the host, with one sync for the whole batch; the tokens in one
    copy (`tokens`), not an `.item()` a row."""
    mx.eval(samples.arrays())
    return [_to_sample(token_id, *row[1:]) for token_id, row in zip(samples.tokens.tolist(), samples.rows)]


def row_arrays(rows: Sequence[LazyRow]) -> list[mx.array]:
    """Every array the rows hold (what evaluating them means)."""
    return [array for row in rows for array in row if array is not None]


def process_logits(row: mx.array, params: SamplingParams, history: TokenHistory,
                   pending: mx.array | None = None) -> mx.array:
    """The distribution a row is drawn from, as logits [V] (its log_softmax is what logprobs report).
    `pending`: a last token not in `history` yet (a scalar on the device), counted as if it were."""
    row = penalize(row, params, history, pending)
    return row if _is_greedy(params) else warp(row, params)


# ---- hard restrictions (structured outputs, min_tokens) ------------------------------------------------


def restrict(row: mx.array, params: SamplingParams, history: TokenHistory, mask: bytes | None,
             num_pending: int = 0) -> mx.array:
    """Disallowed tokens become -inf: those outside `mask`, and stop tokens before `min_tokens` (counting
    `num_pending` tokens sampled but not in `history` yet). row: [V]."""
    allowed = None if mask is None else unpack_mask(mask, row.shape[0])  # [V] bool
    if _holds_stop_tokens(params, history, num_pending):
        allowed = np.ones(row.shape[0], dtype=bool) if allowed is None else allowed.copy()
        stop_ids = np.array([t for t in params.stop_token_ids if 0 <= t < row.shape[0]], dtype=np.int64)
        kept = allowed.copy()
        kept[stop_ids] = False
        allowed = kept if kept.any() else allowed  # a grammar that can only end wins over min_tokens
    if allowed is None:
        return row
    return mx.where(mx.array(allowed), row, -mx.inf)


def _holds_stop_tokens(params: SamplingParams, history: TokenHistory, num_pending: int) -> bool:
    """min_tokens still keeps the stop tokens out (counting `num_pending` tokens not in `history` yet)."""
    return bool(params.min_tokens and params.stop_token_ids
                and history.num_output_tokens + num_pending < params.min_tokens)


def unpack_mask(mask: bytes, vocab_size: int) -> np.ndarray:
    """A packed allowed-token bitmask -> [vocab_size] bool (bits past the mask's end: not allowed)."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab_size].astype(bool)
    if bits.shape[0] < vocab_size:
        bits = np.concatenate([bits, np.zeros(vocab_size - bits.shape[0], dtype=bool)])
    return bits


# ---- argmax-changing adjustments ---------------------------------------------------------------------


def penalize(row: mx.array, params: SamplingParams, history: TokenHistory, pending: mx.array | None = None) -> mx.array:
    """logit_bias, then repetition, frequency and presence penalties. row: [V] float32. `pending`: a last
    token still on the device (a scalar), counted as part of the history: the same bits as once it is
    appended."""
    row = _apply_logit_bias(row, params.logit_bias)
    if params.repetition_penalty != 1.0:
        row = _apply_repetition_penalty(row, history.seen_ids(), params.repetition_penalty, pending)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        row = _apply_frequency_presence(row, history, params.frequency_penalty, params.presence_penalty, pending)
    return row


def _apply_logit_bias(row: mx.array, logit_bias: tuple[tuple[int, float], ...]) -> mx.array:
    if not logit_bias:
        return row
    ids = np.array([token_id for token_id, _ in logit_bias], dtype=np.int64)
    if ids.min() < 0 or ids.max() >= row.shape[0]:
        raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {row.shape[0]})")
    bias = mx.array([value for _, value in logit_bias], dtype=mx.float32)
    return row.at[mx.array(ids)].add(bias)


# Seen tokens and counts are [V] vectors: a pending token's id is on the device only, and it may repeat a seen
# one. Each seen logit gets its float32 operations; the others are left as they are (not `- 0.0`, which would
# turn a -0.0 logit into +0.0).


def _apply_repetition_penalty(row: mx.array, seen_ids: np.ndarray, penalty: float,
                              pending: mx.array | None = None) -> mx.array:
    if seen_ids.size == 0 and pending is None:
        return row
    seen = _per_token(row.shape[0], seen_ids, None, pending)  # [V]: > 0 where seen
    factor = mx.where(row > 0, 1.0 / penalty, penalty)  # shrinks positive logits, pushes negative ones down
    return mx.where(seen > 0, row * factor, row)


def _apply_frequency_presence(row: mx.array, history: TokenHistory, frequency: float, presence: float,
                              pending: mx.array | None = None) -> mx.array:
    ids, counts = history.output_counts()
    if ids.size == 0 and pending is None:
        return row
    generated = _per_token(row.shape[0], ids, counts, pending)  # [V]: how often each token was generated
    return mx.where(generated > 0, row - (frequency * generated + presence), row)


def _per_token(vocab: int, ids: np.ndarray, counts: np.ndarray | None, pending: mx.array | None) -> mx.array:
    """[V] float32: counts[i] (1 without counts) at ids[i], plus 1 at the pending token (a scalar)."""
    out = mx.zeros((vocab,), dtype=mx.float32)
    if ids.size:
        out = out.at[mx.array(ids)].add(mx.array(counts) if counts is not None else 1.0)
    if pending is not None:
        out = out.at[pending.reshape(1)].add(1.0)
    return out


# ---- argmax-keeping warps (random rows only) ---------------------------------------------------------


def warp(row: mx.array, params: SamplingParams) -> mx.array:
    """Temperature, then min_p, top_k, top_p truncation (cut tokens become -inf). row: [V] float32."""
    row = row / params.temperature
    if params.min_p > 0.0:
        row = _apply_min_p(row, params.min_p)
    if params.top_k is not None and params.top_k < row.shape[0]:
        row = _apply_top_k(row, params.top_k)
    if params.top_p < 1.0:
        row = _apply_top_p(row, params.top_p)
    return row


def _apply_min_p(row: mx.array, min_p: float) -> mx.array:
    # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p): no softmax needed.
    threshold = mx.max(row) + float(np.log(min_p))
    return mx.where(row >= threshold, row, -mx.inf)


def _apply_top_k(row: mx.array, top_k: int) -> mx.array:
    # Keep everything tied with the k-th largest logit (as vLLM does).
    threshold = mx.min(mx.topk(row, top_k))
    return mx.where(row >= threshold, row, -mx.inf)


def _apply_top_p(row: mx.array, top_p: float) -> mx.array:
    # Keep the smallest prefix of tokens, by descending probability, whose mass reaches top_p: a token stays
    # while the mass strictly before it is < top_p, so the most likely token always stays.
    sorted_row = -mx.sort(-row)  # [V] descending
    probs = mx.softmax(sorted_row)
    mass_before = mx.cumsum(probs) - probs
    threshold = mx.min(mx.where(mass_before < top_p, sorted_row, mx.inf))
    return mx.where(row >= threshold, row, -mx.inf)


# ---- choosing -------------------------------------------------------------------------------------


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_TEMPERATURE


def _choose(row: mx.array, params: SamplingParams, history: TokenHistory, rng: RequestRng,
            pending: mx.array | None = None) -> LazyRow:
    """Lazy (token [1], then its logprob [1], top-n ids [1, n], their logprobs [1, n] or Nones) for one row;
    evaluated by `read_samples`."""
    processed = process_logits(row, params, history, pending)  # [V]
    if _is_greedy(params):
        token = mx.argmax(processed)  # ties: the lowest id
    else:
        token = mx.random.categorical(processed, key=rng.next_key())
    token = token.reshape(1)
    if params.logprobs is None:
        return token, None, None, None
    logprobs = processed - mx.logsumexp(processed)  # [V]
    return (token, *token_logprobs(logprobs[None], token, params.logprobs))


def _to_sample(
    token_id: int, chosen: mx.array | None, top_ids: mx.array | None, top_values: mx.array | None
) -> Sample:
    if chosen is None:
        return Sample(token_id)
    ((logprob, top),) = ranked_logprobs(chosen, top_ids, top_values)
    return Sample(token_id, logprob, top)


# ---- logprobs on the device, only what is reported copied to the host ----------------------------------


def token_logprobs(
    logprobs: mx.array, token_ids: mx.array, num_top: int
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """logprobs: [n, V], token_ids: [n] -> lazy (each row's token logprob [n], top-k ids [n, k] unordered,
    their logprobs [n, k]) with k = min(num_top, V); the tops are None when k is 0. A [n, V] block never
    needs to reach the host: only these are evaluated and copied."""
    chosen = mx.take_along_axis(logprobs, token_ids.astype(mx.int32)[:, None], axis=-1)[:, 0]  # [n]
    num_top = min(num_top, logprobs.shape[-1])
    if num_top <= 0:
        return chosen, None, None
    top_ids = mx.argpartition(-logprobs, num_top - 1, axis=-1)[:, :num_top]  # [n, k]
    return chosen, top_ids, mx.take_along_axis(logprobs, top_ids, axis=-1)


def ranked_logprobs(
    chosen: mx.array, top_ids: mx.array | None, top_values: mx.array | None
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """`token_logprobs`' arrays -> per row (token logprob, top alternatives by descending logprob, ties by the
    lower id)."""
    chosen_host = np.array(chosen)  # [n]
    if top_ids is None or top_values is None:
        return [(float(value), ()) for value in chosen_host]
    ids_host, values_host = np.array(top_ids), np.array(top_values)  # [n, k] each
    rows = []
    for value, ids, values in zip(chosen_host, ids_host, values_host):
        order = np.lexsort((ids, -values))
        rows.append((float(value), tuple((int(ids[i]), float(values[i])) for i in order)))
    return rows
