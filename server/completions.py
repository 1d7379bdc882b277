"""POST /v1/completions: raw prompts (text or token ids, one or many) in, text out, streamed or whole.

Choice index = prompt index * n + sample index, as in OpenAI's API. `echo` with `logprobs` returns the prompt's
token logprobs first (computed by the prefill itself, engine/serving/runner.py), as lm-evaluation-harness needs.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from tessera.engine.serving.protocol import SamplingParams
from tessera.server.generation import ChoiceRun, Piece, close_runs, collect_all, merge_pieces, open_runs
from tessera.server.logprobs import CompletionLogprobsBuilder
from tessera.server.prepare import (
    RequestLimits,
    ServedModel,
    check_model,
    check_token_ids,
    new_response_id,
    resolve_max_tokens,
    sampling_params,
    start_runs,
    text_prompt_ids,
    until_disconnected,
)
from tessera.server.schemas import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Usage
from tessera.server.sse import Chunk, Keepalive, sse_response
from tessera.server.workers import WorkerPool


def _prompt_ids(body: CompletionRequest, served: ServedModel) -> list[tuple[list[int], str]]:
    """(ids, text to echo) per prompt; a token-id prompt is checked against the vocabulary."""
    tokenizer = served.tokenizer
    prompts = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            ids = text_prompt_ids(tokenizer, prompt, max_model_len=served.info.max_model_len)
            prompts.append((ids, prompt))
        else:
            check_token_ids(prompt, tokenizer.vocab_size, param="prompt")
            prompts.append((list(prompt), tokenizer.decode(prompt, skip_special_tokens=True) if body.echo else ""))
    return prompts


def _wants_prompt_logprobs(body: CompletionRequest) -> bool:
    return body.echo and body.logprobs is not None


def _choices(body: CompletionRequest, served: ServedModel,
             prompts: list[tuple[list[int], str]]) -> list[tuple[list[int], SamplingParams]]:
    choices = []
    for ids, _ in prompts:
        max_tokens = resolve_max_tokens(body.max_tokens, len(ids), served.info.max_model_len, "prompt")
        for _ in range(body.n):
            sampling = sampling_params(body, max_tokens=max_tokens, num_logprobs=body.logprobs,
                                       choice=len(choices), vocab_size=served.tokenizer.vocab_size,
                                       eos_token_id=served.tokenizer.eos_token_id,
                                       prompt_logprobs=body.logprobs if _wants_prompt_logprobs(body) else None)
            choices.append((ids, sampling))
    return choices


async def create_completion(
    body: CompletionRequest, served: ServedModel, inflight: set[str], request: Request, workers: WorkerPool,
    limits: RequestLimits,
) -> Completion | Response:
    body.unsupported_values()
    check_model(body.model, served.info)
    limits.check_stops(body.stop_strings)
    limits.check_num_choices(len(body.prompts()) * body.n, param="prompt" if body.n == 1 else "n")
    prompts = await workers.run(_prompt_ids, body, served)
    echoes = [text for _, text in prompts for _ in range(body.n)] if body.echo else None
    response_id = new_response_id("cmpl")
    runs = start_runs(served, inflight, response_id, _choices(body, served, prompts), body.stop_strings,
                      body.skip_special_tokens)
    head = Completion(id=response_id, created=int(time.time()), model=served.info.name,
                      system_fingerprint=served.info.system_fingerprint, choices=[])
    num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
    if body.stream:
        await until_disconnected(request, open_runs(runs))
        chunks = _chunks(runs, body, served, head, echoes, num_prompt_tokens)
        return sse_response(chunks, lambda: close_runs(runs), served.metrics.http_error, body.include_usage)
    outputs = await until_disconnected(request, _complete(runs))
    choices = [_choice(i, pieces, body, served, echoes, runs[i]) for i, pieces in enumerate(outputs)]
    usage = Usage.of(num_prompt_tokens, sum(run.num_generated_tokens for run in runs), _cached_tokens(runs, body.n))
    return head.model_copy(update={"choices": choices, "usage": usage})


def _cached_tokens(runs: list[ChoiceRun], n: int) -> int:
    """Each prompt's tokens count once in usage (its n choices share them): its first choice's cached tokens."""
    return sum(run.num_cached_tokens for run in runs[::n])


async def _complete(runs: list[ChoiceRun]) -> list[list[Piece]]:
    await open_runs(runs)
    return await collect_all(runs)


def _logprobs_builder(body: CompletionRequest, served: ServedModel, echo: str) -> CompletionLogprobsBuilder:
    # With prompt logprobs the offsets count from the prompt's first token; else from the end of the echo.
    return CompletionLogprobsBuilder(served.tokenizer, 0 if _wants_prompt_logprobs(body) else len(echo))


def _prompt_part(builder: CompletionLogprobsBuilder, run: ChoiceRun) -> CompletionLogprobs:
    return builder.build_prompt(run.prompt_ids, run.prompt_logprobs)


def _choice(index: int, pieces: list[Piece], body: CompletionRequest, served: ServedModel,
            echoes: list[str] | None, run: ChoiceRun) -> CompletionChoice:
    echo = echoes[index] if echoes else ""
    logprobs = None
    if body.logprobs is not None:
        builder = _logprobs_builder(body, served, echo)
        prompt = _prompt_part(builder, run) if _wants_prompt_logprobs(body) else CompletionLogprobs()
        logprobs = _concat(prompt, builder.build([token for piece in pieces for token in piece.tokens]))
    return CompletionChoice(index=index, text=echo + "".join(piece.text for piece in pieces), logprobs=logprobs,
                            finish_reason=pieces[-1].finish_reason if pieces else "stop")


def _concat(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + second.text_offset)


async def _chunks(runs: list[ChoiceRun], body: CompletionRequest, served: ServedModel, head: Completion,
                  echoes: list[str] | None, num_prompt_tokens: int) -> AsyncIterator[Chunk]:
    def usage() -> Usage:
        return Usage.of(num_prompt_tokens, sum(run.num_generated_tokens for run in runs), _cached_tokens(runs, body.n))

    def chunk(choices: list[CompletionChoice], final_usage: Usage | None = None) -> Completion:
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        return head.model_copy(update={"choices": choices,
                                       "usage": final_usage or (usage() if body.continuous_usage else None)})

    builders = [_logprobs_builder(body, served, echoes[i] if echoes else "") for i in range(len(runs))]
    # The echo goes first; with logprobs it waits for the prompt logprobs (all in by the choice's first token).
    unsent_echoes = dict(enumerate(echoes or []))
    if not _wants_prompt_logprobs(body):
        for index in list(unsent_echoes):
            yield chunk([CompletionChoice(index=index, text=unsent_echoes.pop(index))])
    async for index, piece in merge_pieces(runs):
        if piece.is_keepalive:
            yield Keepalive("prefill")
            continue
        if index in unsent_echoes:
            prompt = _prompt_part(builders[index], runs[index])
            yield chunk([CompletionChoice(index=index, text=unsent_echoes.pop(index), logprobs=prompt)])
        logprobs = builders[index].build(piece.tokens) if body.logprobs is not None else None
        if piece.text or piece.finish_reason or (logprobs and logprobs.tokens):
            yield chunk([CompletionChoice(index=index, text=piece.text, logprobs=logprobs,
                                          finish_reason=piece.finish_reason)])
    if body.include_usage:
        yield chunk([], usage())
