"""Engine logprobs -> OpenAI's two logprobs shapes (chat's `content` list, completions' parallel lists).

A token's `token` is its own decode (a lone piece of a multi-byte character decodes to U+FFFD, as in
OpenAI); `bytes` are its exact raw bytes, so a client can reassemble the text byte for byte.
"""

from __future__ import annotations

from typing import Sequence

from engine.serving.protocol import Token
from engine.model.tokenizer import Tokenizer
from server.schemas import CompletionLogprobs, TokenLogprob, TopLogprob


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    return TopLogprob(token=tokenizer.decode([token_id]), logprob=logprob,
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
            out.token_logprobs.append(token.logprob)
            out.top_logprobs.append({self._tokenizer.decode([t]): lp for t, lp in token.top_logprobs})
            out.text_offset.append(self._offset)
            self._offset += len(text)
        return out


def _logprob(token: Token) -> float:
    # The engine fills logprob whenever the request asked for logprobs; a missing one is an engine bug.
    if token.logprob is None:
        raise RuntimeError(f"the engine returned no logprob for token {token.token_id}")
    return token.logprob
