"""The grammars of server/structured_output.py on the tokenizer alone (no model): random walks through the
allowed-token masks always end in output the existing parsers accept (server/dsml.py) and schemas validate."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from tessera.engine.serving.sampler import unpack_mask
from tessera.server.dsml import THINK_END, parse_completion
from tessera.server.structured_output import GrammarCompiler, ToolSpec, full_grammar, json_grammar, plain_or_block_rule, \
    tool_call_grammar

ARGS = {"type": "object", "properties": {
    "q": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": -3, "maximum": 3},
    "opts": {"type": "object", "properties": {"deep": {"type": "boolean"}}, "required": ["deep"],
             "additionalProperties": False}},
    "required": ["q", "opts"], "additionalProperties": False}
TOOLS = [ToolSpec("search", ARGS), ToolSpec("noop", {"type": "object", "properties": {}})]


def walk(tokenizer, grammars: GrammarCompiler, grammar: str, seed: int, prefer: int | None = None) -> str:
    """Draw uniformly among allowed tokens (preferring `prefer` when allowed) until EOS; return the text."""
    constraint = grammars.constraint(grammar)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3000):
        allowed = np.flatnonzero(unpack_mask(constraint.allowed_mask(), tokenizer.vocab_size))
        assert allowed.size > 0
        if prefer is not None and prefer in allowed and rng.random() < 0.2:
            token = prefer
        elif tokenizer.eos_token_id in allowed and rng.random() < 0.5:
            token = tokenizer.eos_token_id  # stop soon once ending is allowed
        else:
            token = int(rng.choice(allowed))
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(out, skip_special_tokens=True)
        constraint.accept(token)
        out.append(token)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_parse_into_valid_calls(tokenizer, parallel):
    grammars = GrammarCompiler(tokenizer)
    grammar = grammars.check(full_grammar(tool_call_grammar(TOOLS, parallel), False, None), "tools")
    for seed in range(12):
        parsed = parse_completion(walk(tokenizer, grammars, grammar, seed), thinking=False)
        assert parsed.content is None and parsed.tool_calls
        assert parallel or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            schema = {t.name: t.parameters for t in TOOLS}[call.name]
            jsonschema.validate(json.loads(call.arguments_json), schema)
    # Two calls are grammatical exactly when parallel calls are on; an optional parameter can be written.
    assert accepts(tokenizer, grammars, grammar, block(NOOP, NOOP)) == parallel
    assert accepts(tokenizer, grammars, grammar, block(SEARCH_ALL))


NOOP = '<｜DSML｜invoke name="noop">\n</｜DSML｜invoke>'
SEARCH_ALL = ('<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="false">"ab"</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="n" string="false">2</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="opts" string="false">{"deep":true}</｜DSML｜parameter>\n</｜DSML｜invoke>')


def block(*invokes: str) -> str:
    return "<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


def accepts(tokenizer, grammars: GrammarCompiler, grammar: str, text: str) -> bool:
    """Whether the grammar allows `text` (as the tokenizer spells it) followed by the end of the sequence."""
    constraint = grammars.constraint(grammar)
    for token in tokenizer.encode(text) + [tokenizer.eos_token_id]:
        if not unpack_mask(constraint.allowed_mask(), tokenizer.vocab_size)[token]:
            return False
        constraint.accept(token)
    return True


def test_thinking_mode_reasons_freely_then_answers_in_json(tokenizer):
    grammars = GrammarCompiler(tokenizer)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    grammar = grammars.check(full_grammar(json_grammar(schema), True, grammars.think_end_id), "response_format")
    for seed in range(5):
        text = walk(tokenizer, grammars, grammar, seed, prefer=grammars.think_end_id)
        assert text.count(THINK_END) == 1
        parsed = parse_completion(text, thinking=True)
        jsonschema.validate(json.loads(parsed.content), schema)


def test_auto_single_call_is_text_or_one_call(tokenizer):
    grammars = GrammarCompiler(tokenizer)
    rules = tool_call_grammar(TOOLS, parallel=False).replace("body:", "block:", 1) + plain_or_block_rule()
    grammar = grammars.check(full_grammar(rules, False, None), "tools")
    for seed in range(10):
        parsed = parse_completion(walk(tokenizer, grammars, grammar, seed), thinking=False)
        assert len(parsed.tool_calls) <= 1
    assert accepts(tokenizer, grammars, grammar, "plain words, no call")
    assert accepts(tokenizer, grammars, grammar, block(NOOP))
    assert not accepts(tokenizer, grammars, grammar, block(NOOP, NOOP))
    assert not accepts(tokenizer, grammars, grammar, "text then " + block(NOOP))


def test_a_schema_llguidance_rejects_is_a_400_naming_the_field(tokenizer):
    from tessera.server.errors import to_api_error
    grammars = GrammarCompiler(tokenizer)
    with pytest.raises(ValueError) as info:
        grammars.check(full_grammar(json_grammar({"type": "nonsense"}), False, None), "response_format.json_schema.schema")
    error = to_api_error(info.value)
    assert error.status == 400 and error.param == "response_format.json_schema.schema"
