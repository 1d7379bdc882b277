"""Pydantic models at the HTTP edge, in OpenAI's shapes (pydantic stays here: docs/ARCHITECTURE.md).

Requests forbid unknown fields: a parameter Tessera does not implement is a 400 that names it
(errors.py turns `extra_forbidden` into `unsupported_parameter`), never silently ignored. A field sent as
`null` counts as not sent, as in OpenAI's API. Parameters Tessera knows but supports only partly
(`modalities`, `best_of`, …) are declared and rejected by value in `unsupported_values()`.
Extensions beyond OpenAI follow vLLM's names: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, stream_options.continuous_usage_stats, chat_template_kwargs.
Fields SDKs send that change no output (`store`, `metadata`, `service_tier`, `user`, `prompt_cache_key`,
`verbosity`, `safety_identifier`) are accepted and logged at debug level (`log_no_op_fields`).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 128  # choices per request; each is one engine request
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's and vLLM's seed range

logger = logging.getLogger("tessera.server")

# Accepted for SDK compatibility; none of them changes what is generated (logged at debug, never silently).
NO_OP_FIELDS = ("store", "metadata", "service_tier", "user", "prompt_cache_key", "verbosity", "safety_identifier")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class Unsupported(Exception):
    """A known parameter with a value Tessera cannot honour; errors.py maps it to a 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


# ---- shared request pieces ------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk too (guidellm sends it)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(_Request):
    """Sampling fields shared by chat and completions (OpenAI ranges; vLLM names for the extras)."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None  # ids checked against the vocabulary in server/prepare.py
    skip_special_tokens: bool = True
    # No-ops (NO_OP_FIELDS): accepted, logged at debug.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    safety_identifier: str | None = None

    def log_no_op_fields(self) -> None:
        sent = {name: getattr(self, name) for name in NO_OP_FIELDS if getattr(self, name, None) is not None}
        if sent:
            logger.debug("accepted without effect: %s", ", ".join(sorted(sent)))

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, value: Any) -> Any:
        return None if value in (-1, 0) else value  # vLLM clients spell "no top-k cut" as -1 (or 0)

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        for token_id, bias in (value or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {token_id} must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def unsupported_values(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options is only allowed when stream is true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise Unsupported("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                              f"({self.max_tokens})")
        self.log_no_op_fields()


# ---- chat -----------------------------------------------------------------------------------------


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def to_prompt_dict(self) -> dict[str, Any]:
        """The plain dict server/chat_format.py renders (it validates roles and content itself)."""
        return self.model_dump(exclude_none=True)


class FunctionDef(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: dict[str, Any]


# OpenAI's levels plus V4's "max"; every level but "none" turns thinking on.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "max"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None

    def unsupported_values(self) -> None:
        super().unsupported_values()
        if self.modalities is not None and self.modalities != ["text"]:
            raise Unsupported("modalities", "only the 'text' modality is supported")
        if self.tool_choice is not None and not self.tools:
            raise Unsupported("tool_choice", "tool_choice is only allowed when tools are specified")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.get("name")
            if name not in {tool.function.name for tool in self.tools or []}:
                raise Unsupported("tool_choice.function.name", f"tool_choice names {name!r}, which is not in tools")
        if self.response_format is not None and self.response_format.type == "json_schema":
            if not isinstance((self.response_format.json_schema or {}).get("schema", {}), dict):
                raise Unsupported("response_format.json_schema.schema", "the schema must be a JSON object")
        if self.forced_tools and self.response_format is not None and self.response_format.type != "text":
            raise Unsupported("response_format", "response_format cannot be combined with a forced tool_choice")
        if self.is_constrained and self.ignore_eos:
            raise Unsupported("ignore_eos", "ignore_eos cannot be combined with structured outputs: the grammar "
                              "decides where the output ends")
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise Unsupported("max_tokens", "send max_completion_tokens or max_tokens, not both")
        unknown = set(self.chat_template_kwargs or {}) - {"thinking"}
        if unknown:
            raise Unsupported(f"chat_template_kwargs.{sorted(unknown)[0]}",
                              "the only chat_template_kwargs key Tessera reads is 'thinking'")

    @property
    def forced_tools(self) -> bool:
        """tool_choice 'required' or a named function: the output is a tool-call block, nothing else."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def is_constrained(self) -> bool:
        """Decoding runs under a grammar (server/structured_output.py)."""
        json_format = self.response_format is not None and self.response_format.type != "text"
        return json_format or self.forced_tools or self.constrains_auto_tools

    @property
    def constrains_auto_tools(self) -> bool:
        """tool_choice 'auto' under a grammar: one call at most (parallel_tool_calls=false) or strict schemas."""
        strict = any(tool.function.strict for tool in self.tools or [])
        return (bool(self.tools) and self.tool_choice in (None, "auto")
                and (not self.parallel_tool_calls or strict))

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen token's logprob plus k alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """Tools rendered into the prompt: none when tool_choice is 'none'."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def thinking(self) -> bool:
        """Thinking mode from `chat_template_kwargs.thinking` or `reasoning_effort` (default: chat mode)."""
        from_kwargs = (self.chat_template_kwargs or {}).get("thinking")
        if from_kwargs is not None and not isinstance(from_kwargs, bool):
            raise Unsupported("chat_template_kwargs.thinking", "chat_template_kwargs.thinking must be a boolean")
        from_effort = None if self.reasoning_effort is None else self.reasoning_effort != "none"
        if from_kwargs is not None and from_effort is not None and from_kwargs != from_effort:
            raise Unsupported("reasoning_effort", "reasoning_effort and chat_template_kwargs.thinking disagree")
        return bool(from_kwargs if from_kwargs is not None else from_effort)

    @property
    def v4_reasoning_effort(self) -> Literal["high", "max"] | None:
        """V4 knows two thinking depths: "max" gets its own system preamble, every other level is "high"."""
        if self.reasoning_effort in (None, "none"):
            return None
        return "max" if self.reasoning_effort == "max" else "high"


# ---- completions ----------------------------------------------------------------------------------

Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Prompt) -> Prompt:
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must not be an empty list")
        return value

    def unsupported_values(self) -> None:
        super().unsupported_values()
        if self.best_of is not None and self.best_of != self.n:
            raise Unsupported("best_of", "best_of other than n is not supported (no server-side ranking)")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


# ---- tokenize / detokenize (vLLM's shapes) --------------------------------------------------------


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: prepend BOS as /v1/completions does
    add_generation_prompt: bool = True  # messages only
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens restored from the prefix cache instead of prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None  # server/version.py: always set; OpenAI always sends it
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None  # server/version.py: always set; OpenAI always sends it
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None  # server/version.py: always set; OpenAI always sends it
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tessera"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionInfo(BaseModel):
    version: str
