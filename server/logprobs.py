"""Engine logprobs -> OpenAI's two logprobs shapes (chat's `content` list, completions' parallel lists).

A token's `token` is its own decode (a lone piece of a multi-byte character decodes to U+FFFD, as in
OpenAI); `bytes` are its exact raw bytes, so a client can reassemble the text byte for byte.

A truncating sampler (top_k, top_p, min_p) gives the tokens it cut a logprob of -inf, which JSON cannot carry;
like OpenAI and vLLM we send the finite floor -9999.0 instead (NaN too), streamed or not.
"""

from __future__ import annotations

import math
from typing import Sequence

from engine.serving.protocol import Token
from engine.model.tokenizer import Tokenizer
from server.schemas import CompletionLogprobs, TokenLogprob, TopLogprob


LOGPROB_FLOOR = -9999.0  # vLLM's value for -inf


def finite_logprob(logprob: float) -> float:
    """-inf and NaN -> the floor; every logprob the API sends passes through here."""
    return logprob if math.isfinite(logprob) and logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    return TopLogprob(token=tokenizer.decode([token_id]), logprob=finite_logprob(logprob),
                      bytes=list(tokenizer.token_bytes(token_id)))


def chat_logprobs(tokenizer: Tokenizer, tokens: Sequence[Token]) -> list[TokenLogprob]:
    entries = []
    for token in tokens:
        chosen = _top(tokenizer, token.token_id, _logprob(token))
        alternatives = [_top(tokenizer, token_id, logprob) for token_id, logprob in token.top_logprobs]
        entries.append(TokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return entries


class CompletionLogprobsBuilder:
    """Completions logprobs for one choice; `text_offset` keeps counting across streamed chunks."""

    def __init__(self, tokenizer: Tokenizer, start_offset: int = 0) -> None:
        self._tokenizer = tokenizer
        self._offset = start_offset

    def build(self, tokens: Sequence[Token]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token in tokens:
            text = self._tokenizer.decode([token.token_id])
            out.tokens.append(text)
            out.token_logprobs.append(None if token.logprob is None else finite_logprob(token.logprob))
            out.top_logprobs.append({self._tokenizer.decode([t]): finite_logprob(lp) for t, lp in token.top_logprobs})
            out.text_offset.append(self._offset)
            self._offset += len(text)
        return out


def _logprob(token: Token) -> float:
    # The engine fills logprob whenever the request asked for logprobs; a missing one is an engine bug.
    if token.logprob is None:
        raise RuntimeError(f"the engine returned no logprob for token {token.token_id}")
    return token.logprob
