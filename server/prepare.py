"""From a validated request to engine requests: prompt ids, context checks, sampling, one run per choice.

Shared by /v1/chat/completions and /v1/completions, so both check the model name, the context length and
the vocabulary the same way and start their choices identically.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence, TypeVar

from starlette.requests import Request

from tessera.engine.serving.protocol import EngineClient, SamplingParams, TokenConstraint
from tessera.engine.model.tokenizer import Tokenizer, TooManyTokens
from tessera.server.chat_format import render_prompt, render_with_template
from tessera.server.errors import APIError, ClientDisconnected, context_length_exceeded, invalid_request, model_not_found
from tessera.server.generation import ChoiceRun
from tessera.server.metrics import Metrics
from tessera.server.schemas import ChatCompletionRequest, SamplingFields
from tessera.server.settings import Settings
from tessera.server.structured_output import GrammarCompiler
from tessera.server.version import system_fingerprint

T = TypeVar("T")

DEFAULT_MODEL_NAME = "tessera-default"


@dataclass(frozen=True)
class ModelInfo:
    """What /v1/models says about the served model."""

    name: str  # the id clients send as `model`
    root: str  # where it came from (model directory)
    max_model_len: int
    created: int  # unix time the server loaded it

    @property
    def system_fingerprint(self) -> str:
        return system_fingerprint(self.root)


@dataclass(frozen=True)
class ServedModel:
    """The loaded model as the routes see it: the engine handle, its tokenizer, facts and metrics."""

    engine: EngineClient
    tokenizer: Tokenizer
    info: ModelInfo
    metrics: Metrics  # the app's (AppState.metrics): each ChoiceRun reports its request to it
    grammars: GrammarCompiler = field(init=False)  # structured outputs; made from the tokenizer

    def __post_init__(self) -> None:
        # lazy inside: llguidance reads the tokenizer on the first constrained request
        object.__setattr__(self, "grammars", GrammarCompiler(self.tokenizer))


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one request may ask for, from the settings; checked before any work starts."""

    default_max_tokens: int  # chat without max_tokens; 0: the rest of the context
    max_stop_strings: int
    max_stop_string_chars: int
    max_choices: int  # engine requests one HTTP request may start (prompts x n)

    @classmethod
    def from_settings(cls, settings: Settings) -> RequestLimits:
        # On an idle server max_num_seqs choices are admitted at once and max_queued_requests wait; one more
        # is refused with queue_full however long the client retries, so it is a 400, not a 503.
        return cls(settings.default_max_tokens, settings.max_stop_strings, settings.max_stop_string_chars,
                   settings.max_num_seqs + settings.max_queued_requests)

    def check_stops(self, stops: Sequence[str]) -> None:
        """Every token is matched against every stop string: their number and length bound that work."""
        if len(stops) > self.max_stop_strings:
            raise invalid_request(f"Too many stop strings: {len(stops)}, at most {self.max_stop_strings} "
                                  "(max_stop_strings)", param="stop")
        longest = max((len(stop) for stop in stops), default=0)
        if longest > self.max_stop_string_chars:
            raise invalid_request(f"A stop string has {longest} characters, at most {self.max_stop_string_chars} "
                                  "(max_stop_string_chars)", param="stop")

    def check_num_choices(self, num_choices: int, param: str) -> None:
        if num_choices > self.max_choices:
            raise invalid_request(
                f"This request needs {num_choices} generations (prompts x n) but the server runs and queues at "
                f"most {self.max_choices} at once (max_num_seqs + max_queued_requests); split it into smaller "
                "requests", param=param)


def served_model_name(settings: Settings) -> str:
    """The model id clients send: known from the settings alone, so /metrics can carry it while loading."""
    if settings.served_model_name is not None:
        return settings.served_model_name
    return settings.model.name if settings.model is not None else DEFAULT_MODEL_NAME


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(requested: str | None, info: ModelInfo) -> None:
    if requested is not None and requested != info.name:
        raise model_not_found(requested)


# ---- prompts ---------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest, thinking: bool,
                    add_generation_prompt: bool = True, max_model_len: int | None = None) -> list[int]:
    """Render the messages in V4's format (or the model dir's Jinja template) and encode; BOS is in the text.

    With `max_model_len`, a prompt that leaves no room for a completion is a 400 (before its ids are built)."""
    messages = [message.to_prompt_dict() for message in body.messages]
    if tokenizer.chat_template:
        text = render_with_template(tokenizer.chat_template, messages, body.active_tools, thinking,
                                    bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "",
                                    add_generation_prompt=add_generation_prompt)
    else:
        text = render_prompt(messages, body.active_tools, thinking, add_generation_prompt=add_generation_prompt,
                             reasoning_effort=body.v4_reasoning_effort if thinking else None)
    return _encode_within(tokenizer, text, max_model_len, num_extra=0, prompt_param="messages")


def text_prompt_ids(tokenizer: Tokenizer, text: str, add_bos: bool = True,
                    max_model_len: int | None = None) -> list[int]:
    """A raw completion prompt: BOS (as the model was trained to start) + the text's tokens."""
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    return bos + _encode_within(tokenizer, text, max_model_len, num_extra=len(bos), prompt_param="prompt")


def _encode_within(tokenizer: Tokenizer, text: str, max_model_len: int | None, num_extra: int,
                   prompt_param: str) -> list[int]:
    if max_model_len is None:
        return tokenizer.encode(text)
    try:
        return tokenizer.encode(text, max_tokens=max(max_model_len - 1 - num_extra, 0))
    except TooManyTokens as exc:
        raise _no_room(max_model_len, exc.num_tokens + num_extra, prompt_param) from None


def _no_room(max_model_len: int, num_prompt_tokens: int, prompt_param: str) -> APIError:
    return context_length_exceeded(
        f"This model's maximum context length is {max_model_len} tokens. However, your {prompt_param} "
        f"resulted in {num_prompt_tokens} tokens, which leaves no room for a completion. "
        f"Please shorten the {prompt_param}.", param=prompt_param)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        # The size in words too: clients (vLLM's suite among them) look for it to tell the user the bound.
        raise invalid_request(f"token id {bad} is outside the vocabulary of {vocab_size} tokens "
                              f"(ids 0..{vocab_size - 1})", param=param)


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int, prompt_param: str,
                       default_cap: int = 0) -> int:
    """The completion budget: as requested if prompt + it fits the context, else a 400; unset: the rest of the
    context, capped at `default_cap` (0: no cap)."""
    if num_prompt_tokens == 0:
        raise invalid_request(f"The {prompt_param} is empty", param=prompt_param)
    if num_prompt_tokens >= max_model_len:
        raise _no_room(max_model_len, num_prompt_tokens, prompt_param)
    if requested is None:
        rest = max_model_len - num_prompt_tokens
        return min(rest, default_cap) if default_cap else rest
    if num_prompt_tokens + requested > max_model_len:
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_param}, {requested} for "
            "the completion). Please reduce the length of the prompt or the completion.", param="max_tokens")
    return requested


# ---- sampling and runs ----------------------------------------------------------------------------


def sampling_params(body: SamplingFields, *, max_tokens: int, num_logprobs: int | None, choice: int,
                    vocab_size: int, eos_token_id: int | None = None, prompt_logprobs: int | None = None,
                    constraint: Callable[[], TokenConstraint] | None = None) -> SamplingParams:
    """Engine sampling for choice `choice`: with a seed, choice i samples with seed + i (distinct, reproducible).
    `constraint` makes each choice its own grammar state (structured outputs)."""
    bias = body.logit_bias or {}
    check_token_ids(list(bias), vocab_size, param="logit_bias")
    requested_stops = tuple(dict.fromkeys(body.stop_token_ids or ()))
    check_token_ids(requested_stops, vocab_size, param="stop_token_ids")
    # EOS as a stop token id: min_tokens masks stop ids (the scheduler ends on EOS either way).
    eos_stop = (eos_token_id,) if eos_token_id is not None and body.min_tokens and not body.ignore_eos else ()
    stop_ids = requested_stops + tuple(t for t in eos_stop if t not in requested_stops)
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        max_tokens=max_tokens,
        seed=None if body.seed is None else body.seed + choice,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=tuple(sorted(bias.items())),
        logprobs=num_logprobs,
        ignore_eos=body.ignore_eos,
        stop_token_ids=stop_ids,
        min_tokens=body.min_tokens,
        prompt_logprobs=prompt_logprobs,
        constraint=constraint() if constraint is not None else None,
    )


def start_runs(served: ServedModel, inflight: set[str], response_id: str,
               prompts: Sequence[tuple[list[int], SamplingParams]], stops: Sequence[str],
               skip_special_tokens: bool = True) -> list[ChoiceRun]:
    """One engine request per (prompt ids, sampling), in choice order; nothing is awaited yet."""
    return [
        ChoiceRun(served.engine, served.tokenizer, f"{response_id}-{index}", prompt_ids, sampling, stops, inflight,
                  served.metrics, skip_special_tokens)
        for index, (prompt_ids, sampling) in enumerate(prompts)
    ]


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (cancellation aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves (server shutdown): take the work down with us
        await _cancel(task, watcher)
        raise
    if task in done:
        await _cancel(watcher)
        return task.result()
    await _cancel(task)
    raise ClientDisconnected()


async def _cancel(*tasks: asyncio.Future) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read before the endpoint ran, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
