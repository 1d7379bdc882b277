"""The HTTP API end to end: the official `openai` client against a real uvicorn server on 127.0.0.1, the real
AsyncEngine over a scripted runner (no model), and a trained byte-level tokenizer with V4's special tokens."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.engine.serving.protocol import Done, SamplingParams, Token
from tessera.server.dsml import render_tool_calls
from server_harness import MODEL_NAME, LiveServer, free_port, live_server, sse_data

REPO_ROOT = Path(__file__).resolve().parents[1]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[LiveServer]:
    with live_server(tokenizer) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer):
    return server.client()


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def sse_events(server: LiveServer, path: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """Raw SSE lines of a streamed request (comments included), to check the wire format itself."""
    with httpx.stream("POST", server.base_url + path, json=body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
        return response.status_code, lines


def data_of(lines: list[str]) -> list[Any]:
    return [data if data == "[DONE]" else json.loads(data) for data in sse_data(lines)]


def streamed_chat(client, **kwargs) -> tuple[list[Any], dict[int, str], dict[int, str]]:
    """(chunks, content by choice, reasoning by choice) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs))
    content: dict[int, str] = {}
    reasoning: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            extra = (choice.delta.model_extra or {}).get("reasoning_content")
            reasoning[choice.index] = reasoning.get(choice.index, "") + (extra or "")
    return chunks, content, reasoning


# ---- basics ----------------------------------------------------------------------------------------


def test_models_health_ready_version(server: LiveServer, client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == 4096
    assert client.models.retrieve(MODEL_NAME).model_extra["max_model_len"] == 4096
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base_url + "/ready").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_chat_non_streamed(server: LiveServer, client) -> None:
    script = server.text_tokens("It is sunny in Paris.")
    server.runner.script("weather in Paris?", script)
    response = client.chat.completions.create(model=MODEL_NAME, messages=user("weather in Paris?"))
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "It is sunny in Paris."
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    prompt = httpx.post(server.base_url + "/tokenize", json={"messages": user("weather in Paris?")}).json()
    assert response.usage.prompt_tokens == prompt["count"]
    assert response.usage.completion_tokens == len(script)  # EOS counts, though it is never text
    assert response.usage.total_tokens == prompt["count"] + len(script)
    assert response.id.startswith("chatcmpl-") and response.model == MODEL_NAME


def test_chat_prompt_is_v4_format(server: LiveServer, client) -> None:
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "system", "content": "Be brief."},
                                                               *user("format check")], max_tokens=1)
    [request_id] = server.runner.requests_with("format check")
    assert server.runner.prompt_by_id[request_id] == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>format check<｜Assistant｜></think>")


@pytest.mark.parametrize("marker", ["scripted stream", "free stream"])
def test_chat_streamed_equals_non_streamed(server: LiveServer, client, marker: str) -> None:
    server.runner.script("scripted stream", server.text_tokens("One, two: three! Done."))
    kwargs = dict(messages=user(marker), max_tokens=40, seed=1)
    whole = client.chat.completions.create(model=MODEL_NAME, **kwargs)
    chunks, content, _ = streamed_chat(client, **kwargs, stream_options={"include_usage": True})
    assert content[0] == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_sse_wire_format(server: LiveServer) -> None:
    status, lines = sse_events(server, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": user("wire"), "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    events = data_of(lines)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3
    assert [e["choices"][0].get("finish_reason") for e in events[:-2]].count("length") == 1


def test_completions_streamed_equals_non_streamed(server: LiveServer, client) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="def main():", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices].count("length") == 1
    assert chunks[-1].usage == whole.usage
    assert whole.usage.prompt_tokens == 1 + len(server.tokenizer.encode("def main():"))  # BOS + text
    assert whole.usage.completion_tokens == 12


def test_completions_prompt_forms(server: LiveServer, client) -> None:
    ids = server.tokenizer.encode("token prompt")
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5)
    assert by_ids.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=MODEL_NAME, prompt=[ids, [5, 6, 7]], max_tokens=5, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_ids.choices[0].text == batch.choices[1].text
    assert batch.usage.prompt_tokens == len(ids) + 3 and batch.usage.completion_tokens == 20
    texts = client.completions.create(model=MODEL_NAME, prompt=["a b", "c d"], max_tokens=2)
    assert len(texts.choices) == 2


def test_completions_echo(server: LiveServer, client) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt="echo me", max_tokens=4, echo=True)
    plain = client.completions.create(model=MODEL_NAME, prompt="echo me", max_tokens=4)
    assert whole.choices[0].text == "echo me" + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="echo me", max_tokens=4, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_greedy_equals_engine_direct_output(server: LiveServer, client) -> None:
    prompt_ids = server.tokenizer.encode("direct engine run")

    async def direct() -> list[int]:
        sampling = SamplingParams(temperature=0.0, max_tokens=10)
        events = [e async for e in server.engine.generate("direct-1", prompt_ids, sampling)]
        assert isinstance(events[-1], Done)
        return [e.token_id for e in events if isinstance(e, Token)]

    expected = asyncio.run(direct())
    response = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=10, temperature=0)
    assert response.choices[0].text == server.tokenizer.decode(expected, skip_special_tokens=True)


def test_multibyte_text_never_breaks(server: LiveServer, client) -> None:
    text = "Café ☕ 你好, naïve — ok"
    server.runner.script("unicode please", server.text_tokens(text))
    _, content, _ = streamed_chat(client, messages=user("unicode please"))
    assert content[0] == text and "\ufffd" not in content[0]


# ---- stop strings ----------------------------------------------------------------------------------


def test_stop_string_split_across_tokens(server: LiveServer, client) -> None:
    text = "alpha beta gamma delta epsilon"
    script = server.text_tokens(text)
    pieces = [server.tokenizer.decode([t]) for t in script]
    assert not any("ta ga" in piece for piece in pieces)  # the stop string spans token boundaries
    server.runner.script("greek letters", script)
    for stream in (False, True):
        if stream:
            _, content, _ = streamed_chat(client, messages=user("greek letters"), stop=["ta ga", "never"])
            assert content[0] == "alpha be"
        else:
            response = client.chat.completions.create(model=MODEL_NAME, messages=user("greek letters"),
                                                      stop="ta ga")
            assert response.choices[0].message.content == "alpha be"
            assert response.choices[0].finish_reason == "stop"
            assert response.usage.completion_tokens < len(script)  # the engine request was cut short
    server.wait_until_idle()  # the stop string aborted the engine request: its sequence is released


def test_stop_string_in_completions_and_unmatched(server: LiveServer, client) -> None:
    server.runner.script("count up", server.text_tokens("one two three four"))
    ids = server.tokenizer.encode("count up")
    cut = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=30, stop=["thr", "four"])
    assert cut.choices[0].text == "one two " and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=30, stop="thr", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "one two "
    full = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=30, stop="zebra")
    assert full.choices[0].text == "one two three four"


# ---- n, seeds, sampling parameters ----------------------------------------------------------------


def test_n_choices(server: LiveServer, client) -> None:
    whole = client.chat.completions.create(model=MODEL_NAME, messages=user("three ways"), n=3, max_tokens=6, seed=10)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 18
    chunks, content, _ = streamed_chat(client, messages=user("three ways"), n=3, max_tokens=6, seed=10)
    assert set(content) == {0, 1, 2}
    for index in range(3):
        own = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert own[0].delta.role == "assistant" and all(c.delta.role is None for c in own[1:])
        assert [c.finish_reason for c in own].count("length") == 1
        assert content[index] == whole.choices[index].message.content
    seeds = sorted(server.runner.sampling_by_id[rid].seed for rid in server.runner.requests_with("three ways"))
    assert seeds == [10, 10, 11, 11, 12, 12]  # choice i samples with seed + i


def test_sampling_parameters_reach_the_engine(server: LiveServer, client) -> None:
    client.chat.completions.create(
        model=MODEL_NAME, messages=user("sampling knobs"), temperature=0.7, top_p=0.9, max_completion_tokens=5,
        presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"42": 5.0, "7": -100}, seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    [request_id] = server.runner.requests_with("sampling knobs")
    assert server.runner.sampling_by_id[request_id] == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=5, seed=3, presence_penalty=0.5,
        frequency_penalty=0.25, repetition_penalty=1.1, logit_bias=((7, -100.0), (42, 5.0)), logprobs=None,
    )


def test_default_max_tokens_is_the_rest_of_the_context(server: LiveServer, client) -> None:
    response = client.chat.completions.create(model=MODEL_NAME, messages=user("unbounded"), max_tokens=None)
    [request_id] = server.runner.requests_with("unbounded")
    assert server.runner.sampling_by_id[request_id].max_tokens == 4096 - response.usage.prompt_tokens


def test_seed_determinism_with_concurrent_traffic(server: LiveServer, client) -> None:
    kwargs = dict(model=MODEL_NAME, messages=user("seeded"), max_tokens=12, seed=1234, temperature=1.0)
    alone = client.chat.completions.create(**kwargs).choices[0].message.content
    results: list[str] = []

    def noise() -> None:
        client.completions.create(model=MODEL_NAME, prompt="background traffic", max_tokens=20)

    threads = [threading.Thread(target=noise) for _ in range(4)]
    for thread in threads:
        thread.start()
    results = [client.chat.completions.create(**kwargs).choices[0].message.content for _ in range(3)]
    for thread in threads:
        thread.join()
    assert results == [alone] * 3


# ---- logprobs --------------------------------------------------------------------------------------


def test_chat_logprobs(server: LiveServer, client) -> None:
    text = "naïve ok"
    server.runner.script("logprob chat", server.text_tokens(text))
    whole = client.chat.completions.create(model=MODEL_NAME, messages=user("logprob chat"), logprobs=True,
                                           top_logprobs=2)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == len(server.tokenizer.encode(text))  # EOS ends the turn and is not listed
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text  # bytes rebuild split characters
    assert all(e.logprob == -0.5 and len(e.top_logprobs) == 2 for e in entries)
    chunks, _, _ = streamed_chat(client, messages=user("logprob chat"), logprobs=True, top_logprobs=2)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=user("logprob chat"))
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(server: LiveServer, client) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt="offsets", max_tokens=6, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.text_offset == offsets
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="offsets", max_tokens=6, logprobs=3,
                                            stream=True))
    streamed = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == offsets


# ---- reasoning and tools ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "how", [{"reasoning_effort": "high"}, {"extra_body": {"chat_template_kwargs": {"thinking": True}}}]
)
def test_reasoning_content_in_thinking_mode(server: LiveServer, client, how: dict[str, Any]) -> None:
    server.runner.script("think about 2+2", server.text_tokens("Two plus two is four.</think>The answer is 4."))
    whole = client.chat.completions.create(model=MODEL_NAME, messages=user("think about 2+2"), **how)
    message = whole.choices[0].message
    assert message.content == "The answer is 4."
    assert message.model_extra["reasoning_content"] == "Two plus two is four."
    _, content, reasoning = streamed_chat(client, messages=user("think about 2+2"), **how)
    assert (content[0], reasoning[0]) == ("The answer is 4.", "Two plus two is four.")
    request_id = server.runner.requests_with("think about 2+2")[-1]
    assert server.runner.prompt_by_id[request_id].endswith("<｜Assistant｜><think>")


def test_chat_mode_has_no_reasoning(server: LiveServer, client) -> None:
    server.runner.script("no thinking", server.text_tokens("Plain answer."))
    message = client.chat.completions.create(model=MODEL_NAME, messages=user("no thinking")).choices[0].message
    assert message.content == "Plain answer." and message.model_extra.get("reasoning_content") is None


def test_tool_calls_end_to_end(server: LiveServer, client) -> None:
    block = render_tool_calls([("get_weather", {"city": "Paris", "days": 3})])
    server.runner.script("tool weather Paris", server.text_tokens("Let me check.\n\n" + block))
    kwargs = dict(messages=user("tool weather Paris"), tools=[WEATHER_TOOL])
    whole = client.chat.completions.create(model=MODEL_NAME, **kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    [request_id] = server.runner.requests_with("tool weather Paris")
    assert "get_weather" in server.runner.prompt_by_id[request_id]  # the tool schema is in the system prompt

    chunks, content, _ = streamed_chat(client, **kwargs)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert content[0] == "Let me check." and len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function.name == "get_weather" and json.loads(deltas[0].function.arguments)["days"] == 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices].count("tool_calls") == 1

    # The client sends the call and its result back: the conversation renders and runs.
    server.runner.script("tool weather Paris", server.text_tokens("Sunny, 21°C."))
    follow_up = client.chat.completions.create(model=MODEL_NAME, tools=[WEATHER_TOOL], messages=[
        *user("tool weather Paris"), choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ])
    assert follow_up.choices[0].message.content == "Sunny, 21°C."
    assert follow_up.choices[0].finish_reason == "stop"


# ---- tokenizer routes, keepalives, cancellation -----------------------------------------------------


def test_tokenize_detokenize(server: LiveServer) -> None:
    result = httpx.post(server.base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": "hello there"}).json()
    assert result["tokens"][0] == server.tokenizer.bos_token_id and result["count"] == len(result["tokens"])
    assert result["max_model_len"] == 4096
    bare = httpx.post(server.base_url + "/tokenize", json={"prompt": "hello there", "add_special_tokens": False})
    assert bare.json()["tokens"] == result["tokens"][1:]
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": bare.json()["tokens"]}).json()
    assert text == {"prompt": "hello there"}


def test_keepalive_comments_during_long_prefill(server: LiveServer) -> None:
    long_prompt = list(range(10, 1010))  # 1000 tokens = 4 prefill chunks of 256
    status, lines = sse_events(server, "/v1/completions", {
        "model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 2, "stream": True})
    assert status == 200 and sum(line.startswith(": prefill") for line in lines) >= 3


@pytest.fixture(scope="module")
def slow_server(tokenizer) -> Iterator[LiveServer]:
    with live_server(tokenizer, step_delay_s=0.02, prefill_chunk=64) as live:
        yield live


def test_streaming_disconnect_aborts(slow_server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "stream then leave", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", slow_server.base_url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break  # mid-decode: leave
    slow_server.wait_until_idle()
    [request_id] = slow_server.runner.requests_with("stream then leave")
    assert request_id in slow_server.runner.released_ids
    assert slow_server.runner.num_sampled_by_id[request_id] < 1000


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_non_streaming_disconnect_aborts(slow_server: LiveServer, when: str) -> None:
    marker = f"whole then leave {when}"
    prompt = marker + " x" * (3000 if when == "prefill" else 0)  # ~3000 tokens: ~47 chunks of 64, ~1 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.base_url + "/v1/completions", timeout=0.5,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1000})
    slow_server.wait_until_idle()
    [request_id] = slow_server.runner.requests_with(marker)
    sampled = slow_server.runner.num_sampled_by_id.get(request_id, 0)
    assert (sampled == 0) if when == "prefill" else (0 < sampled < 1000)


# ---- `tessera serve` itself --------------------------------------------------------------------------


def test_tessera_serve_embedded_default_model(tmp_path: Path) -> None:
    """The newcomer's path: no --model, TESSERA_PORT picks the port; a chat request works; SIGTERM drains."""
    port = free_port()
    env = {**os.environ, "TESSERA_PORT": str(port), "TESSERA_HOME": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "tessera.server.cli", "serve", "--log-level", "warning"], cwd=REPO_ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, process)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="tessera-default", messages=user("hello"), max_tokens=8, seed=0)
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens <= 8
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tessera-default", messages=user("hello"), max_tokens=8, seed=0, temperature=0, stream=True))
        greedy = client.chat.completions.create(model="tessera-default", messages=user("hello"), max_tokens=8,
                                                temperature=0)
        assert streamed == greedy.choices[0].message.content
        # Production wiring (serve.build_engine): the engine's steps and memory reach /metrics.
        samples = [sample for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text)
                   for sample in family.samples]

        def total(name: str, **labels: str) -> float:
            return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

        assert total("tessera_request_success_total") == 3
        assert total("tessera_generation_tokens_total") >= reply.usage.completion_tokens + 2
        assert total("tessera_memory_bytes", kind="weights") > 0

        results: list[Any] = []
        in_flight = threading.Thread(target=lambda: results.append(client.completions.create(
            model="tessera-default", prompt="drain me", max_tokens=64)))
        in_flight.start()
        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        in_flight.join(60)
        assert results and results[0].usage.completion_tokens >= 1  # finished, not dropped
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert "Traceback" not in output, output


def _wait_ready(base_url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"tessera serve exited early:\n{process.communicate()[0]}")
        try:
            if httpx.get(base_url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("tessera serve never became ready")
