"""Parsing V4 output: reasoning, content and DSML tool calls, whole or streamed at any split."""

from __future__ import annotations

import json
import random

import pytest

from tessera.server.dsml import (
    Delta,
    ParsedOutput,
    StreamingOutputParser,
    ToolCall,
    parse_completion,
    parse_tool_calls_block,
    render_tool_calls,
)


def _ids(i: int) -> str:
    return f"call_{i}"


def _parse(text: str, thinking: bool = False) -> ParsedOutput:
    return parse_completion(text, thinking, call_id=_ids)


def _param(name: str, value: str, string: bool) -> str:
    return f'<｜DSML｜parameter name="{name}" string="{"true" if string else "false"}">{value}</｜DSML｜parameter>'


def _block(*invokes: str) -> str:
    return "<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


def _invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜invoke>"


WEATHER = _invoke("get_weather", _param("city", "Paris", True), _param("days", "3", False))
SEARCH = _invoke(
    "search",
    _param("query", "42", True),  # looks like JSON, but string="true" keeps it text
    _param("filters", '{"lang": ["en", "fr"], "safe": true, "since": null}', False),
    _param("ratio", "0.25", False),
)


# ---- whole-text parsing ----------------------------------------------------------------------------


def test_chat_mode_text_is_all_content():
    assert _parse("Hello </think> world") == ParsedOutput("Hello </think> world", None, [])


def test_thinking_mode_splits_reasoning_at_think_end():
    assert _parse("Let me see.\n</think>It is 4.", thinking=True) == ParsedOutput("It is 4.", "Let me see.\n", [])


def test_thinking_cut_off_before_think_end_is_all_reasoning():
    assert _parse("still thinking <｜DSML｜tool_calls>", thinking=True) == ParsedOutput(
        None, "still thinking <｜DSML｜tool_calls>", []
    )


def test_multiple_calls_with_string_and_json_parameters():
    parsed = _parse("Checking both.\n\n" + _block(WEATHER, SEARCH))
    assert parsed.content == "Checking both."
    assert [c.id for c in parsed.tool_calls] == ["call_0", "call_1"]
    assert [(c.name, json.loads(c.arguments_json)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("search", {"query": "42", "filters": {"lang": ["en", "fr"], "safe": True, "since": None}, "ratio": 0.25}),
    ]


def test_reasoning_then_tool_call_only():
    parsed = _parse("need weather</think>\n\n" + _block(WEATHER), thinking=True)
    assert parsed == ParsedOutput(
        None, "need weather", [ToolCall("call_0", "get_weather", '{"city": "Paris", "days": 3}')]
    )


def test_string_parameters_keep_text_verbatim():
    raw = '  multi\nline "quoted" <b>html</b> 🎉 '
    (call,) = _parse(_block(_invoke("echo", _param("text", raw, True)))).tool_calls
    assert json.loads(call.arguments_json) == {"text": raw}


def test_invoke_without_parameters():
    (call,) = _parse(_block(_invoke("now"))).tool_calls
    assert (call.name, call.arguments_json) == ("now", "{}")


def test_mislabelled_non_json_value_is_kept_as_text():
    (call,) = _parse(_block(_invoke("f", _param("x", "not json", False)))).tool_calls
    assert json.loads(call.arguments_json) == {"x": "not json"}


def test_whitespace_around_tool_blocks_is_not_content():
    parsed = _parse("A\n\n" + _block(WEATHER) + "\nB\n")
    assert parsed.content == "A\nB"  # the separator before the block and the tail after calls go
    assert len(parsed.tool_calls) == 1
    assert _parse(_block(WEATHER) + "\n").content is None
    assert _parse("no calls\n").content == "no calls\n"


MALFORMED = [
    "Sure.\n\n<｜DSML｜tool_calls>\n" + WEATHER,  # never closed (cut off by max_tokens)
    _block('<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x">1</｜DSML｜invoke>'),  # parameter never closed
    _block(_invoke("f", _param("x", "1", False), _param("x", "2", False))),  # duplicate parameter
    _block(""),  # no invoke
    _block(WEATHER, "garbage between invokes", SEARCH),
    _block("<｜DSML｜invoke>\n</｜DSML｜invoke>"),  # no name
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_blocks_are_left_as_content(text):
    assert _parse(text) == ParsedOutput(text, None, [])


def test_a_good_block_after_a_malformed_one_still_parses():
    bad = _block("oops")
    parsed = _parse(bad + "\n\n" + _block(WEATHER))
    assert parsed.content == bad
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]


def test_render_and_parse_are_inverse():
    calls = [("a", {"s": "x</y>", "n": -1.5e3, "b": True, "l": [], "o": {"k": "v"}}), ("b", {})]
    assert parse_tool_calls_block(render_tool_calls(calls)) == calls


def test_default_call_ids_are_unique():
    parsed = parse_completion(_block(WEATHER, WEATHER), thinking=False)
    first, second = (c.id for c in parsed.tool_calls)
    assert first.startswith("call_") and first != second


# ---- streaming ---------------------------------------------------------------------------------------

STREAM_CASES = [
    ("plain answer with trailing newline\n", False),
    ("thinking about </th and </think>answer < ｜ <｜DSML｜tool_call but not a block", True),
    ("reasoning</think>Let me check.\n\n" + _block(WEATHER, SEARCH) + "\n", True),
    ("  \n" + _block(WEATHER) + "\n\nthen more text\n\n" + _block(SEARCH), False),
    *((text, False) for text in MALFORMED),
    ("no end of thinking <｜DSML｜tool_calls>", True),
    ("", True),
    ("</think>", True),
]


def _stream(pieces: list[str], thinking: bool) -> list[Delta]:
    parser = StreamingOutputParser(thinking, call_id=_ids)
    deltas = [d for piece in pieces for d in parser.feed(piece)]
    return deltas + parser.finish()


def _check_deltas(deltas: list[Delta]) -> None:
    for d in deltas:
        fields = [d.content, d.reasoning_content, d.tool_call]
        assert sum(f is not None for f in fields) == 1 and d.content != "" and d.reasoning_content != ""


@pytest.mark.parametrize(("text", "thinking"), STREAM_CASES)
def test_streaming_at_every_split_point_equals_whole_parse(text, thinking):
    expected = _parse(text, thinking)
    for cut in range(len(text) + 1):
        deltas = _stream([text[:cut], text[cut:]], thinking)
        _check_deltas(deltas)
        assert ParsedOutput.from_deltas(deltas) == expected, cut


@pytest.mark.parametrize(("text", "thinking"), STREAM_CASES)
def test_streaming_character_by_character_and_random_chunks(text, thinking):
    expected = _parse(text, thinking)
    assert ParsedOutput.from_deltas(_stream(list(text), thinking)) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 5)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert ParsedOutput.from_deltas(_stream(pieces, thinking)) == expected


def test_partial_markers_are_held_back_until_decided():
    parser = StreamingOutputParser(thinking=True, call_id=_ids)
    assert parser.feed("abc</th") == [Delta(reasoning_content="abc")]
    assert parser.feed("ink>Hi\n\n<｜DS") == [Delta(content="Hi")]
    assert parser.feed("x") == [Delta(content="\n\n<｜DSx")]  # not a marker after all


def test_tool_call_is_emitted_when_its_block_closes():
    parser = StreamingOutputParser(thinking=False, call_id=_ids)
    text = _block(WEATHER)
    assert parser.feed(text[:-1]) == []
    assert parser.feed(text[-1]) == [Delta(tool_call=ToolCall("call_0", "get_weather", '{"city": "Paris", "days": 3}'))]
    assert parser.finish() == []
