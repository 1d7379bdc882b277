"""Structured outputs: `response_format` (json_object, json_schema) and forced tool calls, as llguidance grammars.

Why llguidance (docs/STRUCTURED_OUTPUT.md): it builds token masks straight from an HF `tokenizers` byte-level
BPE (V4's), takes JSON Schema and Lark grammars with JSON Schema embedded (`%json`), so one grammar can say
"DSML tool-call markup around schema-valid arguments", and computes a mask in tens of microseconds.

A grammar here is Lark text. Chat mode's output is the body (JSON, or the DSML block); in thinking mode the
reasoning comes first, free text up to the `</think>` token, then the body. Tool-call values are written as
JSON with `string="false"` for every parameter (server/dsml.py parses those with json.loads), so every argument,
strings included, is constrained by its own schema.

`GrammarConstraint` is the engine's `TokenConstraint` (engine/serving/protocol.py): the runner asks it for
masks and tells it the sampled tokens; the engine never imports llguidance.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import llguidance

from tessera.engine.model.tokenizer import Tokenizer
from tessera.server.dsml import DSML, TOOL_CALLS_END, TOOL_CALLS_START, THINK_END

logger = logging.getLogger("tessera.server")

# Compact JSON: whitespace between tokens is not free text a random (or rambling) model can loop in.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar llguidance rejects (a bad schema); server/errors.py maps it to a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]  # JSON Schema of the arguments object


# ---- grammars (Lark text) --------------------------------------------------------------------------


def _json_rule(schema: dict[str, Any]) -> str:
    with_options = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(with_options, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal is a JSON string


def json_grammar(schema: dict[str, Any] | None) -> str:
    """response_format: any JSON object (json_object) or one valid against `schema` (json_schema)."""
    return "body: " + _json_rule(schema if schema is not None else {"type": "object"}) + "\n"


def tool_call_grammar(tools: list[ToolSpec], parallel: bool, rule: str = "body") -> str:
    """One DSML tool-call block with one invoke (or more when `parallel`) of the given tools, as the
    rule named `rule` ("body": the whole answer is the block; "block": for `plain_or_block_rule`).

    Every piece after the block's opening starts with its own "\\n" (`\\n<｜DSML｜invoke…`, `\\n<｜DSML｜parameter…`,
    `\\n</｜DSML｜invoke>`): a lone "\\n" terminal would be a prefix of the closing ones, and llguidance's lexer,
    greedy, would then never split them."""
    lines = []
    invoke_rules = []
    for i, tool in enumerate(tools):
        params, rules = _parameter_rules(tool, f"t{i}")
        invoke_rules.append(f"invoke_{i}")
        head = _literal(f'\n<{DSML}invoke name="{tool.name}">')
        tail = _literal(f"\n</{DSML}invoke>")
        lines.append(f"invoke_{i}: {head} {params} {tail}")
        lines.extend(rules)
    invokes = "invoke: " + " | ".join(invoke_rules)
    calls = "invoke+" if parallel else "invoke"
    block = f"{rule}: {_literal(TOOL_CALLS_START)} {calls} {_literal(chr(10) + TOOL_CALLS_END)}"
    return "\n".join([block, invokes, *lines]) + "\n"


def _parameter_rules(tool: ToolSpec, prefix: str) -> tuple[str, list[str]]:
    """The invoke's parameter sequence (required ones always, optional ones maybe, in schema order)."""
    properties: dict[str, Any] = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    parts, rules = [], []
    for j, (name, schema) in enumerate(properties.items()):
        rule = f"{prefix}_p{j}"
        head = _literal(f'\n<{DSML}parameter name="{name}" string="false">')
        rules.append(f"{rule}: {head} {_json_rule(schema if isinstance(schema, dict) else {})} "
                     f"{_literal(f'</{DSML}parameter>')}")
        parts.append(rule if name in required else f"{rule}?")
    return (" ".join(parts) if parts else '""'), rules


def plain_or_block_rule() -> str:
    """'auto' tool choice: text without a tool-call block, or the one block of
    `tool_call_grammar(..., rule="block")`."""
    marker = TOOL_CALLS_START.replace("/", "\\/")
    return f"body: PLAIN | block\nPLAIN: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/\n"


def full_grammar(body_rules: str, thinking: bool, think_end_id: int | None) -> str:
    """`start`: the body, after free reasoning ending in the `</think>` token when thinking."""
    if not thinking:
        return "start: body\n" + body_rules
    think_end = f"<[{think_end_id}]>" if think_end_id is not None else _literal(THINK_END)
    reasoning = 'REASONING: /(.|\\n)*/ & ~/(.|\\n)*<\\/think>(.|\\n)*/'
    return f"start: REASONING {think_end} body\n{reasoning}\n" + body_rules


# ---- the engine's TokenConstraint --------------------------------------------------------------------


class GrammarConstraint:
    """One request's grammar state over llguidance's matcher (implements engine TokenConstraint)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int, vocab_size: int) -> None:
        self._matcher = matcher
        self._eos_token_id = eos_token_id
        self._vocab_size = vocab_size

    def allowed_mask(self) -> bytes:
        if self._matcher.is_error():
            # Cannot happen for tokens from our own masks; end the sequence rather than sample from nothing.
            logger.error("structured output grammar failed: %s", self._matcher.get_error())
            return _only(self._eos_token_id, self._vocab_size)
        return self._matcher.compute_bitmask()

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            logger.error("structured output grammar refused token %d: %s", token_id, self._matcher.get_error())

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()


def _only(token_id: int, vocab_size: int) -> bytes:
    mask = bytearray((vocab_size + 31) // 32 * 4)
    mask[token_id // 8] |= 1 << (token_id % 8)
    return bytes(mask)


class GrammarCompiler:
    """Builds constraints for one served tokenizer (its llguidance view is made once, on first use)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer.eos_token_id is None:
                    raise GrammarError("structured outputs need a tokenizer with an end-of-sequence token")
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(),
                                                            eos_token=self._tokenizer.eos_token_id)
            return self._ll_tokenizer

    @property
    def think_end_id(self) -> int | None:
        return self._tokenizer.id_of(THINK_END)

    def check(self, lark: str, param: str) -> str:
        """Compile `lark` once to catch a bad schema; returns llguidance's grammar. Raises a 400 naming `param`."""
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(f"Invalid schema for structured output: {messages[0]}", param=param)
        return grammar

    def constraint(self, grammar: str) -> GrammarConstraint:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"Invalid schema for structured output: {matcher.get_error()}")
        return GrammarConstraint(matcher, self._tokenizer.eos_token_id, self._tokenizer.vocab_size)
