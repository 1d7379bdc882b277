"""DeepSeek-V4's output markup: reasoning before `</think>` and DSML tool-call blocks.

A V4 completion looks like (thinking mode; in chat mode the prompt already ends with `</think>`):

    step-by-step reasoning</think>The answer is…

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

(`encoding/encoding_dsv4.py` in DeepSeek's V4 model repos.) `string="true"` values are raw text,
the others are JSON. This module renders that markup for the prompt (`render_tool_calls`) and parses
it back, streamed or whole. The whole-text parse *is* the streaming parser fed once, so streamed
output concatenated equals the non-streamed parse by construction; the tests feed every split point.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

THINK_END = "</think>"
DSML = "｜DSML｜"  # fullwidth ｜ (U+FF5C), as in DeepSeek's tokenizer
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"

_INVOKE_RE = re.compile(rf'\s*<{DSML}invoke name="(?P<name>[^"]+)">(?P<body>.*?)</{DSML}invoke>', re.S)
_PARAM_RE = re.compile(
    rf'\s*<{DSML}parameter name="(?P<name>[^"]+)"(?: string="(?P<string>true|false)")?>'
    rf"(?P<value>.*?)</{DSML}parameter>",
    re.S,
)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str  # a JSON object, as OpenAI's `function.arguments`


@dataclass(frozen=True)
class Delta:
    """One piece of streamed output; exactly one field is set."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_call: ToolCall | None = None


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_deltas(cls, deltas: Iterable[Delta]) -> ParsedOutput:
        """Fold a stream of deltas into the message a non-streamed response carries (empty -> None)."""
        deltas = list(deltas)
        content = "".join(d.content for d in deltas if d.content is not None)
        reasoning = "".join(d.reasoning_content for d in deltas if d.reasoning_content is not None)
        return cls(content or None, reasoning or None, [d.tool_call for d in deltas if d.tool_call is not None])


# ---- rendering (assistant tool calls in the prompt) ----------------------------------------------


def render_tool_calls(calls: Iterable[tuple[str, Mapping[str, Any]]]) -> str:
    """The `<｜DSML｜tool_calls>` block for (name, arguments) pairs; the inverse of `parse_tool_calls_block`."""
    invokes = [
        f'<{DSML}invoke name="{name}">\n{_render_parameters(arguments)}\n</{DSML}invoke>' for name, arguments in calls
    ]
    return f"{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _render_parameters(arguments: Mapping[str, Any]) -> str:
    lines = []
    for key, value in arguments.items():
        is_string = isinstance(value, str)
        text = value if is_string else json.dumps(value, ensure_ascii=False)
        lines.append(
            f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">{text}</{DSML}parameter>'
        )
    return "\n".join(lines)


# ---- parsing -------------------------------------------------------------------------------------


def parse_tool_calls_block(block: str) -> list[tuple[str, dict[str, Any]]] | None:
    """(name, arguments) for each invoke of one complete block, or None if it is malformed."""
    if not (block.startswith(TOOL_CALLS_START) and block.endswith(TOOL_CALLS_END)):
        return None
    body = block[len(TOOL_CALLS_START) : len(block) - len(TOOL_CALLS_END)]
    calls: list[tuple[str, dict[str, Any]]] = []
    pos = 0
    while match := _INVOKE_RE.match(body, pos):
        arguments = _parse_parameters(match["body"])
        if arguments is None:
            return None
        calls.append((match["name"], arguments))
        pos = match.end()
    return calls if calls and not body[pos:].strip() else None


def _parse_parameters(body: str) -> dict[str, Any] | None:
    arguments: dict[str, Any] = {}
    pos = 0
    while match := _PARAM_RE.match(body, pos):
        if match["name"] in arguments:
            return None  # the reference decoder rejects duplicate names too
        arguments[match["name"]] = _parameter_value(match["value"], match["string"])
        pos = match.end()
    return arguments if not body[pos:].strip() else None


def _parameter_value(text: str, string_flag: str | None) -> Any:
    """string="true" is raw text; otherwise JSON. A mislabelled non-JSON value is kept as text
    rather than losing the whole call: the client's tool can still reject it."""
    if string_flag == "true":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class _Phase(enum.Enum):
    REASONING = "reasoning"  # before </think> (thinking mode only)
    CONTENT = "content"
    TOOL_BLOCK = "tool_block"  # inside <｜DSML｜tool_calls>, waiting for its end


def _random_call_id(index: int) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class StreamingOutputParser:
    """Splits streamed model text into reasoning, content and complete tool calls.

    Text that might be the start of a marker (`</think>`, `<｜DSML｜tool_calls>`) is held back until
    decided, and so is trailing content whitespace: the format puts "\\n\\n" before a tool-call block,
    which is not content. A tool call is emitted once its whole block has arrived and parsed; a block
    that does not parse, or never closes, is passed through as content. Once the output has tool
    calls, whitespace at its very end is dropped too.
    """

    def __init__(self, thinking: bool, call_id: Callable[[int], str] | None = None) -> None:
        self._phase = _Phase.REASONING if thinking else _Phase.CONTENT
        self._pending = ""  # received but not yet decided
        self._held_ws = ""  # whitespace before the current tool block, restored if the block is malformed
        self._block_scanned = 0  # how far the open tool block was searched for its end (blocks can be long)
        self._num_tool_calls = 0
        self._call_id = call_id or _random_call_id

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return _coalesce(out)

    def finish(self) -> list[Delta]:
        """End of output: release whatever is still held."""
        out: list[Delta] = []
        pending, self._pending = self._pending, ""
        if self._phase is _Phase.REASONING:
            _emit(out, reasoning_content=pending)
        elif self._phase is _Phase.TOOL_BLOCK:
            _emit(out, content=self._held_ws + pending)  # the block never closed
        elif pending.strip() or self._num_tool_calls == 0:
            _emit(out, content=pending)  # trailing whitespace after tool calls is dropped
        return out

    def _step(self, out: list[Delta]) -> bool:
        """Advance as far as the pending text allows; False when more text is needed."""
        if self._phase is _Phase.REASONING:
            return self._reasoning_step(out)
        if self._phase is _Phase.CONTENT:
            return self._content_step(out)
        return self._tool_block_step(out)

    def _reasoning_step(self, out: list[Delta]) -> bool:
        end = self._pending.find(THINK_END)
        if end < 0:
            decided = len(self._pending) - _partial_marker_len(self._pending, THINK_END)
            _emit(out, reasoning_content=self._pending[:decided])
            self._pending = self._pending[decided:]
            return False
        _emit(out, reasoning_content=self._pending[:end])
        self._pending = self._pending[end + len(THINK_END) :]
        self._phase = _Phase.CONTENT
        return True

    def _content_step(self, out: list[Delta]) -> bool:
        start = self._pending.find(TOOL_CALLS_START)
        if start < 0:
            undecided = len(self._pending) - _partial_marker_len(self._pending, TOOL_CALLS_START)
            decided = len(self._pending[:undecided].rstrip())  # whitespace waits: a block may follow
            _emit(out, content=self._pending[:decided])
            self._pending = self._pending[decided:]
            return False
        before = self._pending[:start]
        content = before.rstrip()
        _emit(out, content=content)
        self._held_ws = before[len(content) :]
        self._pending = self._pending[start:]
        self._phase = _Phase.TOOL_BLOCK
        return True

    def _tool_block_step(self, out: list[Delta]) -> bool:
        end = self._pending.find(TOOL_CALLS_END, self._block_scanned)
        if end < 0:
            self._block_scanned = max(0, len(self._pending) - len(TOOL_CALLS_END) + 1)
            return False
        end += len(TOOL_CALLS_END)
        block, self._pending = self._pending[:end], self._pending[end:]
        calls = parse_tool_calls_block(block)
        if calls is None:
            _emit(out, content=self._held_ws + block)
        for name, arguments in calls or ():
            call = ToolCall(self._call_id(self._num_tool_calls), name, json.dumps(arguments, ensure_ascii=False))
            out.append(Delta(tool_call=call))
            self._num_tool_calls += 1
        self._held_ws = ""
        self._block_scanned = 0
        self._phase = _Phase.CONTENT
        return True


def parse_completion(text: str, thinking: bool, call_id: Callable[[int], str] | None = None) -> ParsedOutput:
    """Split a whole completion into content, reasoning and tool calls (`call_id(i)` names call i)."""
    parser = StreamingOutputParser(thinking, call_id)
    return ParsedOutput.from_deltas([*parser.feed(text), *parser.finish()])


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _emit(out: list[Delta], *, content: str = "", reasoning_content: str = "") -> None:
    if content:
        out.append(Delta(content=content))
    if reasoning_content:
        out.append(Delta(reasoning_content=reasoning_content))


def _coalesce(deltas: list[Delta]) -> list[Delta]:
    """Merge neighbouring text deltas of one kind, so a feed yields as few events as it can."""
    merged: list[Delta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last and last.content is not None and delta.content is not None:
            merged[-1] = Delta(content=last.content + delta.content)
        elif last and last.reasoning_content is not None and delta.reasoning_content is not None:
            merged[-1] = Delta(reasoning_content=last.reasoning_content + delta.reasoning_content)
        else:
            merged.append(delta)
    return merged
