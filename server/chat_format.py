"""OpenAI chat messages -> DeepSeek-V4 prompt text.

V4 ships no Jinja chat template; its format is defined by the Python encoder in the model repos
(`encoding/encoding_dsv4.py`, also vendored by vLLM as `deepseek_v4_encoding.py`). This is that
format, written from the OpenAI side (validation errors name the request field). One rendered round:

    <｜begin▁of▁sentence｜>{system}\\n\\n{tools section}
    <｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>   (one line; wrapped here)

- The generation prompt is `<｜Assistant｜>` + `</think>` in chat mode, + `<think>` in thinking mode.
- Thinking mode drops the reasoning of assistant turns before the last user turn (and those turns
  then follow `</think>`); when the request has tools, reasoning is kept everywhere (interleaved
  thinking across tool calls), as in the reference encoder.
- There is no tool role: consecutive tool/user messages become one user turn whose parts (texts and
  `<tool_result>…</tool_result>` blocks, the latter sorted into call order) are joined by "\\n\\n".
- Assistant tool calls are a DSML block after the content (server/dsml.py); every assistant turn ends
  with EOS.

`render_with_template` serves model dirs that do ship a Jinja `chat_template` (sandboxed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tessera.server.dsml import DSML, render_tool_calls

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

# Prepended to the prompt in thinking mode with reasoning_effort="max" (verbatim from the reference).
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

Role = Literal["system", "developer", "user", "assistant"]
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatFormatError(ValueError):
    """A request's messages cannot be rendered; `param` names the offending field (OpenAI `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class _ToolResult:
    call_id: str
    content: str


@dataclass(frozen=True)
class _Turn:
    """One V4 turn. A user turn may carry tool results; a system turn may carry the request's tools."""

    role: Role
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[tuple[str, str, dict[str, Any]], ...] = ()  # (id, name, arguments)
    parts: tuple[str | _ToolResult, ...] = ()  # user turns: texts and tool results, in message order
    tools: tuple[dict[str, Any], ...] = ()  # system turn: function schemas


# ---- public API ----------------------------------------------------------------------------------


def render_prompt(
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
    *,
    reasoning_effort: Literal["high", "max"] | None = None,
) -> str:
    """The V4 prompt text for OpenAI chat `messages` (and `tools`), BOS included.

    With `add_generation_prompt` the text ends with `<｜Assistant｜>` + `<think>`/`</think>`, ready to
    sample the reply; without it, the conversation is rendered as is (e.g. for /tokenize).
    """
    if reasoning_effort not in (None, "high", "max"):
        raise ChatFormatError(f"reasoning_effort must be 'high' or 'max', got {reasoning_effort!r}", "reasoning_effort")
    turns = _parse_messages(messages)
    function_schemas = _parse_tools(tools)
    if function_schemas:
        turns = _attach_tools(turns, function_schemas)
    # The reference keeps all reasoning when tools are defined: tool-use reasoning spans turns.
    drop_thinking = thinking and not function_schemas
    if drop_thinking:
        turns = _drop_old_thinking(turns)

    prompt = BOS
    if thinking and reasoning_effort == "max":
        prompt += REASONING_EFFORT_MAX
    last_user = _last_user_index(turns)
    for index, turn in enumerate(turns):
        prompt += _render_turn(turn, show_reasoning=thinking and (not drop_thinking or index > last_user))
        if _opens_assistant_turn(turns, index) and (index < len(turns) - 1 or add_generation_prompt):
            # Only replies from the last user turn on think; earlier ones had their thinking dropped.
            prompt += _assistant_opening(think=thinking and (not drop_thinking or index >= last_user))
    if add_generation_prompt and turns[-1].role in ("system", "assistant"):
        # Beyond the reference (which leaves such a prompt without a reply slot): always end ready to sample.
        prompt += _assistant_opening(think=thinking)
    return prompt


def render_with_template(
    template: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool = False,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """Render a model dir's Jinja `chat_template` the way transformers does, in a sandbox.

    `raise_exception(...)` in the template and runtime template errors become ChatFormatError;
    a template that does not compile is a configuration error and raises jinja2.TemplateSyntaxError.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatFormatError("each message must be an object with a string role", f"messages[{index}]")
    try:
        return _compile_template(template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            thinking=thinking,
            enable_thinking=thinking,  # the name most templates (Qwen, DeepSeek V3.1) check
        )
    except jinja2.TemplateError as error:
        raise ChatFormatError(f"chat template rejected the messages: {error}", "messages") from error


# ---- messages -> turns ---------------------------------------------------------------------------


def _parse_messages(messages: Any) -> list[_Turn]:
    """Validate OpenAI messages and fold tool results into user turns (V4 has no tool role)."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list", "messages")
    turns: list[_Turn] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ChatFormatError("each message must be an object", where)
        role = message.get("role")
        if role not in _ROLES:
            raise ChatFormatError(f"unknown role {role!r}; expected one of {', '.join(_ROLES)}", f"{where}.role")
        if role in ("user", "tool"):
            part = _text(message, where) if role == "user" else _tool_result(message, where)
            if turns and turns[-1].role == "user":  # consecutive user/tool messages share one turn
                turns[-1] = replace(turns[-1], parts=turns[-1].parts + (part,))
            else:
                turns.append(_Turn("user", parts=(part,)))
        elif role == "assistant":
            turns.append(_assistant_turn(message, where))
        else:
            content = _text(message, where)
            if role == "developer" and not content:
                raise ChatFormatError("developer messages need content", f"{where}.content")
            turns.append(_Turn(role, content=content))
    return _order_tool_results(turns)


def _text(message: dict, where: str, required: bool = True) -> str:
    """Message content as text: a string, or the text parts of a list joined by newlines."""
    content = message.get("content")
    if content is None and not required:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError("content must be a string or a list of text parts", f"{where}.content")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ChatFormatError("only text content parts are supported", f"{where}.content[{index}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_result(message: dict, where: str) -> _ToolResult:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ChatFormatError("tool messages need the tool_call_id they answer", f"{where}.tool_call_id")
    return _ToolResult(call_id, _text(message, where))


def _assistant_turn(message: dict, where: str) -> _Turn:
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatFormatError("reasoning_content must be a string", f"{where}.reasoning_content")
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise ChatFormatError("tool_calls must be a list", f"{where}.tool_calls")
    calls = tuple(_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(raw_calls))
    return _Turn(
        "assistant", content=_text(message, where, required=False), reasoning=reasoning or "", tool_calls=calls
    )


def _tool_call(call: Any, where: str) -> tuple[str, str, dict[str, Any]]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ChatFormatError("a tool call needs a function object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ChatFormatError("a tool call needs a function name", f"{where}.function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise ChatFormatError(f"arguments are not valid JSON: {error}", f"{where}.function.arguments") from error
    if not isinstance(arguments, dict):
        raise ChatFormatError("arguments must be a JSON object", f"{where}.function.arguments")
    call_id = call.get("id")
    return (call_id if isinstance(call_id, str) else "", name, arguments)


def _order_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """Put each user turn's tool results in the order of the assistant's calls, texts staying in place
    (the reference sorts them so; clients may answer parallel calls in any order)."""
    order: dict[str, int] = {}
    ordered: list[_Turn] = []
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {call_id: i for i, (call_id, _, _) in enumerate(turn.tool_calls) if call_id}
        results = [p for p in turn.parts if isinstance(p, _ToolResult)]
        if len(results) > 1 and order:
            queue = iter(sorted(results, key=lambda r: order.get(r.call_id, 0)))
            turn = replace(turn, parts=tuple(next(queue) if isinstance(p, _ToolResult) else p for p in turn.parts))
        ordered.append(turn)
    return ordered


def _parse_tools(tools: Any) -> list[dict[str, Any]]:
    """The function schemas of OpenAI `tools` ([{type: function, function: {...}}])."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError("tools must be a list", "tools")
    schemas = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ChatFormatError("only tools of type 'function' are supported", f"tools[{index}].type")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatFormatError("a tool needs a function with a name", f"tools[{index}].function.name")
        schemas.append(function)
    return schemas


def _attach_tools(turns: list[_Turn], schemas: list[dict[str, Any]]) -> list[_Turn]:
    """Tools live in the system prompt: the leading system turn, or a new empty one."""
    if turns[0].role == "system":
        return [replace(turns[0], tools=tuple(schemas)), *turns[1:]]
    return [_Turn("system", tools=tuple(schemas)), *turns]


def _drop_old_thinking(turns: list[_Turn]) -> list[_Turn]:
    """Before the last user turn: assistant reasoning goes, developer turns go (as the reference does)."""
    last_user = _last_user_index(turns)
    kept = []
    for index, turn in enumerate(turns):
        if index < last_user and turn.role == "developer":
            continue
        kept.append(replace(turn, reasoning="") if index < last_user and turn.role == "assistant" else turn)
    return kept


def _last_user_index(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


# ---- turns -> text -------------------------------------------------------------------------------


def _render_turn(turn: _Turn, show_reasoning: bool) -> str:
    """One turn's text; `show_reasoning` says whether an assistant turn shows its `…</think>` block."""
    if turn.role == "system":
        return turn.content + ("\n\n" + _render_tools(turn.tools) if turn.tools else "")
    if turn.role == "developer":
        return USER + turn.content
    if turn.role == "user":
        return USER + "\n\n".join(
            p if isinstance(p, str) else f"<tool_result>{p.content}</tool_result>" for p in turn.parts
        )
    reasoning = turn.reasoning + THINK_END if show_reasoning else ""
    calls = "\n\n" + render_tool_calls((name, args) for _, name, args in turn.tool_calls) if turn.tool_calls else ""
    return reasoning + turn.content + calls + EOS


def _assistant_opening(think: bool) -> str:
    return ASSISTANT + (THINK_START if think else THINK_END)


def _opens_assistant_turn(turns: list[_Turn], index: int) -> bool:
    """A user/developer turn is followed by `<｜Assistant｜>` unless more user-side turns come first."""
    is_last = index == len(turns) - 1
    return turns[index].role in ("user", "developer") and (is_last or turns[index + 1].role == "assistant")


def _render_tools(schemas: tuple[dict[str, Any], ...]) -> str:
    return TOOLS_TEMPLATE.format(
        dsml=DSML,
        think_start=THINK_START,
        think_end=THINK_END,
        schemas="\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas),
    )


# ---- Jinja ---------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
    """A transformers-compatible sandboxed environment (same options, filters and globals)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
