"""The DeepSeek-V4 prompt format, as a client's messages come out on the model's side."""

from __future__ import annotations

import json

import pytest

from tessera.server.chat_format import ChatFormatError, render_prompt, render_with_template
from tessera.server.dsml import parse_completion

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_system_user_assistant_conversation_in_chat_mode():
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ]
    assert render_prompt(messages) == (
        "<｜begin▁of▁sentence｜>You are terse."
        "<｜User｜>Hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜></think>"
    )


def test_thinking_mode_opens_a_think_block_and_drops_earlier_reasoning():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "OLD REASONING"},
        {"role": "user", "content": "2+2?"},
    ]
    prompt = render_prompt(messages, thinking=True)
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜><think>"
    )
    assert "OLD REASONING" not in render_prompt(messages, thinking=False)


def test_reasoning_is_kept_everywhere_when_tools_are_defined():
    """V4 keeps interleaved thinking across tool calls (the reference encoder disables dropping)."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "call the tool",
            "tool_calls": [_call("c1", "get_weather", {"city": "Paris"})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    prompt = render_prompt(messages, tools=[WEATHER_TOOL], thinking=True)
    assert "<｜User｜>Weather?<｜Assistant｜><think>call the tool</think>\n\n<｜DSML｜tool_calls>" in prompt
    assert prompt.endswith("<｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>")


def test_full_tool_round_in_chat_mode():
    messages = [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("c1", "get_weather", {"city": "Paris", "days": 3})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
    ]
    prompt = render_prompt(messages, tools=[WEATHER_TOOL])
    system, rest = prompt.split("<｜User｜>", 1)
    assert system.startswith("<｜begin▁of▁sentence｜>Be helpful.\n\n## Tools\n\n")
    assert json.dumps(WEATHER_TOOL["function"]) in system  # one JSON schema per line
    assert system.endswith(
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )
    assert "<｜User｜>" + rest == (
        "<｜User｜>Weather in Paris for 3 days?<｜Assistant｜></think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        '<｜User｜><tool_result>{"sky": "sunny"}</tool_result><｜Assistant｜></think>'
    )


def test_tools_without_a_system_message_get_their_own_system_prompt():
    prompt = render_prompt([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL])
    assert prompt.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n")
    assert prompt.endswith("<｜User｜>Hi<｜Assistant｜></think>")


def test_parallel_tool_results_fold_into_one_user_turn_in_call_order():
    messages = [
        {"role": "user", "content": "Compare"},
        {"role": "assistant", "content": "", "tool_calls": [_call("a", "f", {"x": 1}), _call("b", "f", {"x": 2})]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},  # answered out of order
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "user", "content": "and now?"},
    ]
    prompt = render_prompt(messages)
    assert prompt.endswith(
        "<｜end▁of▁sentence｜><｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand now?"
        "<｜Assistant｜></think>"
    )
    assert prompt.count("<｜User｜>") == 2


def test_rendered_tool_calls_parse_back_to_the_same_arguments():
    arguments = {
        "query": 'naïve 🎉 "quoted"\nline',
        "limit": 5,
        "exact": False,
        "tags": ["a", {"b": None}],
        "ratio": 0.5,
    }
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [_call("c", "search", arguments)]},
    ]
    prompt = render_prompt(messages, add_generation_prompt=False)
    completion = prompt.split("<｜Assistant｜></think>", 1)[1].removesuffix("<｜end▁of▁sentence｜>")
    parsed = parse_completion(completion, thinking=False, call_id=lambda i: f"call_{i}")
    assert parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments_json)) for c in parsed.tool_calls] == [("search", arguments)]


def test_every_assistant_turn_ends_with_eos():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    prompt = render_prompt(messages, add_generation_prompt=False)
    assert prompt.count("<｜end▁of▁sentence｜>") == 2 and prompt.endswith("d<｜end▁of▁sentence｜>")


def test_without_generation_prompt_the_last_user_turn_stays_open():
    assert (
        render_prompt([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
        == "<｜begin▁of▁sentence｜><｜User｜>Hi"
    )


def test_generation_prompt_after_a_trailing_assistant_turn():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert render_prompt(messages, thinking=True).endswith("Hello.<｜end▁of▁sentence｜><｜Assistant｜><think>")


def test_content_parts_and_developer_role():
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
    ]
    # V4 renders a developer message as a user-side turn of its own, directly followed by the user's.
    assert (
        render_prompt(messages)
        == "<｜begin▁of▁sentence｜><｜User｜>Answer in French.<｜User｜>Hello\nthere<｜Assistant｜></think>"
    )


def test_reasoning_effort_max_prefixes_the_prompt_in_thinking_mode():
    messages = [{"role": "user", "content": "Hi"}]
    assert render_prompt(messages, thinking=True, reasoning_effort="max").startswith(
        "<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum"
    )
    assert render_prompt(messages, thinking=False, reasoning_effort="max") == render_prompt(messages)


@pytest.mark.parametrize(
    ("messages", "tools", "param"),
    [
        ([], None, "messages"),
        ([{"role": "robot", "content": "x"}], None, "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}], None, "messages[1].tool_call_id"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {}}]}],
            None,
            "messages[0].content[1]",
        ),
        ([{"role": "user", "content": None}], None, "messages[0].content"),
        ([{"role": "user"}, "not a message"], None, "messages[0].content"),
        (
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
            ],
            None,
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            None,
            "messages[0].tool_calls[0].function.name",
        ),
        ([{"role": "user", "content": "x"}], [{"type": "retrieval"}], "tools[0].type"),
        ([{"role": "user", "content": "x"}], [{"type": "function", "function": {}}], "tools[0].function.name"),
    ],
)
def test_malformed_requests_name_the_field(messages, tools, param):
    with pytest.raises(ChatFormatError) as error:
        render_prompt(messages, tools=tools)
    assert error.value.param == param


# ---- Jinja templates -------------------------------------------------------------------------------

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}"
    "[{{ m.role }}]{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% if thinking %}<think>{% endif %}{% endif %}"
)


def test_render_with_template():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "?"},
    ]
    out = render_with_template(TEMPLATE, messages, None, True, "<s>", "</s>")
    assert out == "<s>[user]Hi[assistant]Yo</s>[user]?[assistant]<think>"


def test_template_raise_exception_is_a_chat_format_error():
    with pytest.raises(ChatFormatError, match="bad role system"):
        render_with_template(TEMPLATE, [{"role": "system", "content": "x"}], None, False, "", "")


def test_template_runs_sandboxed():
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatFormatError):
        render_with_template(escape, [{"role": "user", "content": "x"}], None, False, "", "")
    mutate = "{{ messages.append(1) }}"
    with pytest.raises(ChatFormatError):
        render_with_template(mutate, [{"role": "user", "content": "x"}], None, False, "", "")
