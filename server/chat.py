"""POST /v1/chat/completions: V4 prompt in, reasoning / content / tool calls out, streamed or whole.

Model text is split by server/dsml.py: the streamed path feeds its StreamingOutputParser piece by piece,
the whole path calls parse_completion, which is that same parser fed once — so streamed deltas
concatenated equal the non-streamed message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from tessera.engine.model.tokenizer import Tokenizer
from tessera.server.dsml import Delta, StreamingOutputParser, ToolCall, parse_completion
from tessera.server.generation import ChoiceRun, Piece, close_runs, collect_all, merge_pieces, open_runs
from tessera.server.logprobs import chat_logprobs
from tessera.server.prepare import (
    RequestLimits,
    ServedModel,
    chat_prompt_ids,
    check_model,
    new_response_id,
    resolve_max_tokens,
    sampling_params,
    start_runs,
    until_disconnected,
)
from tessera.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from tessera.server.sse import Chunk, Keepalive, sse_response
from tessera.server.structured_output import (
    GrammarCompiler,
    GrammarConstraint,
    ToolSpec,
    full_grammar,
    json_grammar,
    plain_or_block_rule,
    tool_call_grammar,
)
from tessera.server.workers import WorkerPool


@dataclass(frozen=True)
class _Meta:
    id: str
    created: int
    model: str
    system_fingerprint: str


async def create_chat_completion(
    body: ChatCompletionRequest, served: ServedModel, inflight: set[str], request: Request, workers: WorkerPool,
    limits: RequestLimits,
) -> ChatCompletion | Response:
    body.unsupported_values()
    check_model(body.model, served.info)
    limits.check_stops(body.stop_strings)
    limits.check_num_choices(body.n, param="n")
    thinking = body.thinking()
    prompt_ids = await workers.run(chat_prompt_ids, served.tokenizer, body, thinking, True, served.info.max_model_len)
    max_tokens = resolve_max_tokens(body.requested_max_tokens, len(prompt_ids), served.info.max_model_len, "messages",
                                    default_cap=limits.default_max_tokens)
    constraint = _constraint_factory(body, thinking, served.grammars)
    choices = [
        (prompt_ids, sampling_params(body, max_tokens=max_tokens, num_logprobs=body.num_logprobs, choice=i,
                                     vocab_size=served.tokenizer.vocab_size,
                                     eos_token_id=served.tokenizer.eos_token_id, constraint=constraint))
        for i in range(body.n)
    ]
    meta = _Meta(new_response_id("chatcmpl"), int(time.time()), served.info.name, served.info.system_fingerprint)
    runs = start_runs(served, inflight, meta.id, choices, body.stop_strings, body.skip_special_tokens)
    if body.stream:
        await until_disconnected(request, open_runs(runs))
        return sse_response(_chunks(runs, body, thinking, served.tokenizer, meta), lambda: close_runs(runs),
                            served.metrics.http_error, body.include_usage)
    outputs = await until_disconnected(request, _complete(runs))
    return ChatCompletion(
        id=meta.id, created=meta.created, model=meta.model, system_fingerprint=meta.system_fingerprint,
        choices=[_choice(i, pieces, body, thinking, served.tokenizer) for i, pieces in enumerate(outputs)],
        usage=Usage.of(len(prompt_ids), sum(run.num_generated_tokens for run in runs), runs[0].num_cached_tokens),
    )


def _constraint_factory(body: ChatCompletionRequest, thinking: bool,
                        grammars: GrammarCompiler) -> Callable[[], GrammarConstraint] | None:
    """The grammar this request decodes under (None: free text), checked once; one constraint per choice."""
    if not body.is_constrained:
        return None
    if body.forced_tools or body.constrains_auto_tools:
        tools = [ToolSpec(t.function.name, t.function.parameters or {}) for t in body.tools]
        if isinstance(body.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.name == body.tool_choice.function.get("name")]
        if body.forced_tools:
            rules = tool_call_grammar(tools, parallel=body.parallel_tool_calls)
        else:  # 'auto': plain text, or one block (one call unless parallel_tool_calls)
            rules = tool_call_grammar(tools, parallel=body.parallel_tool_calls, rule="block") + plain_or_block_rule()
        param = "tools"
    else:
        response_format = body.response_format
        schema = None
        if response_format.type == "json_schema":
            schema = (response_format.json_schema or {}).get("schema", {})
        rules = json_grammar(schema)
        param = "response_format.json_schema.schema" if schema is not None else "response_format"
    grammar = grammars.check(full_grammar(rules, thinking, grammars.think_end_id), param)
    return lambda: grammars.constraint(grammar)


async def _complete(runs: list[ChoiceRun]) -> list[list[Piece]]:
    await open_runs(runs)
    return await collect_all(runs)


def _finish_reason(reason: str | None, num_tool_calls: int) -> str:
    """A turn that ended by itself after emitting tool calls ends with 'tool_calls', as OpenAI's do."""
    reason = reason or "stop"
    return "tool_calls" if reason == "stop" and num_tool_calls else reason


def _tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments_json))


# ---- whole response -----------------------------------------------------------------------------------


def _choice(index: int, pieces: list[Piece], body: ChatCompletionRequest, thinking: bool,
            tokenizer: Tokenizer) -> ChatChoice:
    parsed = parse_completion("".join(piece.text for piece in pieces), thinking)
    tool_calls = [_tool_call_out(call) for call in parsed.tool_calls]
    # Content is null only beside tool calls; an empty answer is "" (what the stream's deltas add up to).
    content = parsed.content if parsed.content is not None or tool_calls else ""
    message = AssistantMessage(content=content, reasoning_content=parsed.reasoning_content,
                               tool_calls=tool_calls or None)
    logprobs = None
    if body.logprobs:
        tokens = [token for piece in pieces for token in piece.tokens]
        logprobs = ChatLogprobs(content=chat_logprobs(tokenizer, tokens))
    return ChatChoice(index=index, message=message, logprobs=logprobs,
                      finish_reason=_finish_reason(pieces[-1].finish_reason if pieces else None, len(tool_calls)))


# ---- streamed response ----------------------------------------------------------------------------------


class _StreamedChoice:
    """One choice's streaming state: its output parser, tool-call count and logprobs not yet sent."""

    def __init__(self, index: int, thinking: bool, tokenizer: Tokenizer, want_logprobs: bool) -> None:
        self.index = index
        self._parser = StreamingOutputParser(thinking)
        self._tokenizer = tokenizer
        self._want_logprobs = want_logprobs
        self._num_tool_calls = 0
        self._pending_logprobs: list = []

    def first(self) -> ChatChunkChoice:
        """The role goes in a choice's first chunk only."""
        return ChatChunkChoice(index=self.index, delta=ChatDelta(role="assistant", content=""))

    def on_piece(self, piece: Piece) -> list[ChatChunkChoice]:
        deltas = self._parser.feed(piece.text)
        if piece.finish_reason is not None:
            deltas += self._parser.finish()
        if self._want_logprobs:
            self._pending_logprobs += chat_logprobs(self._tokenizer, piece.tokens)
        out = [ChatChunkChoice(index=self.index, delta=self._delta(d)) for d in deltas]
        if piece.finish_reason is not None:  # exactly one chunk per choice carries finish_reason
            reason = _finish_reason(piece.finish_reason, self._num_tool_calls)
            out.append(ChatChunkChoice(index=self.index, delta=ChatDelta(), finish_reason=reason))
        if out and self._pending_logprobs:  # a token's logprobs ride with the first text it produced
            out[0].logprobs = ChatLogprobs(content=self._pending_logprobs)
            self._pending_logprobs = []
        return out

    def _delta(self, delta: Delta) -> ChatDelta:
        if delta.tool_call is None:
            return ChatDelta(content=delta.content, reasoning_content=delta.reasoning_content)
        call = _tool_call_out(delta.tool_call)
        self._num_tool_calls += 1
        return ChatDelta(tool_calls=[ToolCallDelta(index=self._num_tool_calls - 1, **call.model_dump())])


async def _chunks(runs: list[ChoiceRun], body: ChatCompletionRequest, thinking: bool, tokenizer: Tokenizer,
                  meta: _Meta) -> AsyncIterator[Chunk]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                                   system_fingerprint=meta.system_fingerprint, choices=choices, usage=usage)

    def usage() -> Usage:
        return Usage.of(runs[0].num_prompt_tokens, sum(run.num_generated_tokens for run in runs),
                        runs[0].num_cached_tokens)

    def running_usage() -> Usage | None:  # vLLM's continuous_usage_stats: usage on every chunk as well
        return usage() if body.continuous_usage else None

    states = [_StreamedChoice(i, thinking, tokenizer, body.logprobs) for i in range(len(runs))]
    for state in states:
        yield chunk([state.first()], running_usage())
    async for index, piece in merge_pieces(runs):
        if piece.is_keepalive:
            yield Keepalive("prefill")
            continue
        for choice in states[index].on_piece(piece):
            yield chunk([choice], running_usage())
    if body.include_usage:
        yield chunk([], usage())
