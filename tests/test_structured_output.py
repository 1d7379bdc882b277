"""Structured outputs with the random tiny model: valid by construction, streamed and not (issue 15).

The model's weights are random, so whatever it 'wants' to write is noise: every answer below is valid only
because the grammar masks (server/structured_output.py, applied by engine/serving/sampler.py) allow nothing else.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tessera.engine.tools.make_model import make_model
from tessera.server.settings import Settings
from tests.equivalence.row_invariant_blas import row_invariant_blas
from tests.server_harness import openai_client, real_server

MODEL = "tiny-random"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer", "minimum": 10000,
                                                                             "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "score", "role", "tags", "address", "active"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["c", "f"]},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 2},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = make_model(tmp_path_factory.mktemp("so"), "tiny", seed=0, with_tokenizer=True)
    settings = Settings(model=model_dir, served_model_name=MODEL, prefill_chunk=256, indexer_tile=64, max_num_seqs=8,
                        max_context=4096)
    with real_server(settings) as (base_url, _):
        yield openai_client(base_url, timeout=300)


def _messages(text: str = "Describe a person.") -> list[dict]:
    return [{"role": "user", "content": text}]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_with_random_weights(client):
    response = client.chat.completions.create(model=MODEL, messages=_messages(), n=6, temperature=1.0, seed=1,
                                              max_tokens=400, response_format=_schema_format(SCHEMA))
    assert len(response.choices) == 6
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_streamed_validates_and_equals_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=_messages(), temperature=0.0, max_tokens=400,
                  response_format=_schema_format(SCHEMA))
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_json_object_is_a_json_object(client):
    """Free-form keys and strings have no length bound, so a random model may run to max_tokens ('length', a
    truncated object, as OpenAI's); every answer that ends by itself parses to an object."""
    response = client.chat.completions.create(model=MODEL, messages=_messages(), n=6, temperature=1.0, seed=2,
                                              max_tokens=150, response_format={"type": "json_object"})
    for choice in response.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_without_parallel_calls_gives_exactly_one_valid_call(client, stream):
    kwargs = dict(model=MODEL, messages=_messages("Weather in Paris?"), tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=400)
    if not stream:
        calls_per_choice = [c.message.tool_calls for c in client.chat.completions.create(n=4, **kwargs).choices]
        reasons = [c.finish_reason for c in client.chat.completions.create(n=1, **kwargs).choices]
    else:
        calls, reasons = [], []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                calls += choice.delta.tool_calls or []
                reasons += [choice.finish_reason] if choice.finish_reason else []
        calls_per_choice = [calls]
    assert reasons == ["tool_calls"]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for calls in calls_per_choice:
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])


def test_named_tool_choice_calls_that_function(client):
    response = client.chat.completions.create(
        model=MODEL, messages=_messages("Time?"), tools=TOOLS, n=3, seed=9, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert [call.function.name for call in choice.message.tool_calls] == ["get_time"] * len(choice.message.tool_calls)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])


def test_auto_tools_without_parallel_calls_never_make_two_calls(client):
    response = client.chat.completions.create(model=MODEL, messages=_messages("Weather?"), tools=TOOLS, n=4, seed=3,
                                              parallel_tool_calls=False, max_tokens=60)
    for choice in response.choices:
        assert len(choice.message.tool_calls or []) <= 1


def test_unconstrained_chat_is_not_json(client):
    """Guards the tests above: without a grammar the random model does not write valid JSON by chance."""
    response = client.chat.completions.create(model=MODEL, messages=_messages(), n=3, seed=1, max_tokens=40)
    for choice in response.choices:
        with pytest.raises(ValueError):
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


# ---- the mask decides, not the model ----------------------------------------------------------------------
# Each of these has a tiny chance to hold for a random model without the grammar mask (test_unconstrained_chat_
# is_not_json shows how far its text is from JSON): they fail if the mask is dropped, applied to another row, or
# its bits read in another order.

CHOICES = ["alpha", "beta", "gamma"]
CODE = {"type": "string", "pattern": "^[a-c]{3}-[0-9]{2}$"}


def _answers(client, schema: dict, n: int, seed: int) -> list[str]:
    response = client.chat.completions.create(model=MODEL, messages=_messages("Pick one."), n=n, temperature=1.0,
                                              seed=seed, max_tokens=40, response_format=_schema_format(schema))
    assert [c.finish_reason for c in response.choices] == ["stop"] * n
    return [json.loads(c.message.content) for c in response.choices]


def test_an_enum_schema_answers_only_one_of_its_choices(client):
    answers = _answers(client, {"enum": CHOICES}, n=8, seed=21)
    assert set(answers) <= set(CHOICES)
    assert len(set(answers)) > 1  # the draw still chooses: the mask narrows, it does not force one answer


def test_a_pattern_schema_answers_strings_matching_the_regex(client):
    for answer in _answers(client, CODE, n=6, seed=22):
        assert re.fullmatch(CODE["pattern"][1:-1], answer), answer


@row_invariant_blas
def test_masks_follow_their_own_request_in_a_mixed_batch(client):
    """Constrained and unconstrained requests decode in the same steps: each row gets its own request's mask.
    A seeded unconstrained answer is the same sent alone or among constrained ones (a row's draw depends only on
    its logits, its mask and its key), and every constrained answer still validates."""
    def constrained(seed: int) -> str:
        response = client.chat.completions.create(model=MODEL, messages=_messages(), temperature=1.0, seed=seed,
                                                  max_tokens=400, response_format=_schema_format(SCHEMA))
        return response.choices[0].message.content

    def free(seed: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=_messages(), seed=seed, temperature=1.0,
                                              max_tokens=30).choices[0].message.content

    alone = [free(seed) for seed in (31, 32, 33)]
    with ThreadPoolExecutor(6) as pool:
        picks = [pool.submit(constrained, seed) for seed in (34, 35, 36)]  # long answers: they outlive the others
        frees = [pool.submit(free, seed) for seed in (31, 32, 33)]
        assert [f.result() for f in frees] == alone
        for pick in picks:
            jsonschema.validate(json.loads(pick.result()), SCHEMA)
