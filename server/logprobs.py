"""Engine logprobs -> OpenAI's two logprobs shapes (chat's `content` list, completions' parallel lists).

A token's `token` is its own decode; a token whose bytes are not whole UTF-8 characters (a piece of a
multi-byte character) is spelled `bytes:\\xe2\\x80` as OpenAI does, so distinct tokens stay distinct keys in
completions' `top_logprobs` dicts. `bytes` are its exact raw bytes, so a client can reassemble the text byte for byte.
Completions' `top_logprobs` hold the requested alternatives plus the sampled token (up to logprobs + 1 entries,
as OpenAI's). With `echo`, the prompt's tokens come first; the first prompt token has no logprob (null).

A truncating sampler (top_k, top_p, min_p) gives the tokens it cut a logprob of -inf, which JSON cannot carry;
like OpenAI and vLLM we send the finite floor -9999.0 instead (NaN too), streamed or not.
"""

from __future__ import annotations

import math
from typing import Sequence

from tessera.engine.serving.protocol import PromptLogprob, Token
from tessera.engine.model.tokenizer import Tokenizer
from tessera.server.schemas import CompletionLogprobs, TokenLogprob, TopLogprob


LOGPROB_FLOOR = -9999.0  # vLLM's value for -inf


def finite_logprob(logprob: float) -> float:
    """-inf and NaN -> the floor; every logprob the API sends passes through here."""
    return logprob if math.isfinite(logprob) and logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """The token as logprobs name it: its text, or `bytes:\\xNN…` when its bytes are not valid UTF-8 alone."""
    raw = tokenizer.token_bytes(token_id)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return tokenizer.decode([token_id])


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    return TopLogprob(token=token_text(tokenizer, token_id), logprob=finite_logprob(logprob),
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

    def build(self, tokens: Sequence[Token | PromptLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token in tokens:
            self._add(out, token.token_id, token.logprob, token.top_logprobs)
        return out

    def build_prompt(self, prompt_ids: Sequence[int], entries: Sequence[PromptLogprob]) -> CompletionLogprobs:
        """The echoed prompt: the first token has no logprob (null), then one entry per following token."""
        if len(entries) != len(prompt_ids) - 1:
            raise RuntimeError(f"the engine returned {len(entries)} prompt logprobs for {len(prompt_ids)} tokens")
        out = CompletionLogprobs()
        self._add(out, prompt_ids[0], None, None)
        for entry in entries:
            self._add(out, entry.token_id, entry.logprob, entry.top_logprobs)
        return out

    def _add(self, out: CompletionLogprobs, token_id: int, logprob: float | None,
             top: Sequence[tuple[int, float]] | None) -> None:
        name = token_text(self._tokenizer, token_id)
        logprob = None if logprob is None else finite_logprob(logprob)
        out.tokens.append(name)
        out.token_logprobs.append(logprob)
        if top is None:
            out.top_logprobs.append(None)
        else:
            alternatives = {token_text(self._tokenizer, t): finite_logprob(lp) for t, lp in top}
            if logprob is not None:
                alternatives.setdefault(name, logprob)  # the sampled token is always listed, as OpenAI does
            out.top_logprobs.append(alternatives)
        out.text_offset.append(self._offset)
        self._offset += len(self._tokenizer.decode([token_id]))


def _logprob(token: Token) -> float:
    # The engine fills logprob whenever the request asked for logprobs; a missing one is an engine bug.
    if token.logprob is None:
        raise RuntimeError(f"the engine returned no logprob for token {token.token_id}")
    return token.logprob
