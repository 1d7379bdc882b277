"""Every error the HTTP API reports: exact status, OpenAI error `type`, `code` and `param`, through the real server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Iterator

import httpx
import openai
import pytest

from tessera.server.app import create_app
from tessera.server.settings import Settings
from server_harness import (
    CHAT, COMPLETIONS, MODEL_NAME, LiveServer, chat, completion, live_server, serving, sse_chunks,
)



@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[LiveServer]:
    with live_server(tokenizer, max_model_len=512, max_body_bytes=64 * 1024) as live:
        yield live


def post(server: LiveServer | str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    base = server if isinstance(server, str) else server.base_url
    return httpx.post(base + path, json=body, timeout=30, **kwargs)


def assert_error(response: httpx.Response, status: int, type_: str, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"]) == (type_, param), error
    if code is not None:
        assert error["code"] == code, error
    return error


# ---- 400: validation, naming the field ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"model": MODEL_NAME}, "messages"),
        (CHAT, chat(messages=[]), "messages"),
        (CHAT, chat(temperature="hot"), "temperature"),
        (CHAT, chat(temperature=2.5), "temperature"),
        (CHAT, chat(top_p=0), "top_p"),
        (CHAT, chat(n=0), "n"),
        (CHAT, chat(max_tokens=0), "max_tokens"),
        (CHAT, chat(top_logprobs=21, logprobs=True), "top_logprobs"),
        (CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
        (CHAT, chat(stop=["ok", ""]), "stop"),
        (CHAT, chat(logit_bias={"5": 500}), "logit_bias"),
        (CHAT, chat(reasoning_effort="extreme"), "reasoning_effort"),
        (COMPLETIONS, {"model": MODEL_NAME}, "prompt"),
        (COMPLETIONS, completion(prompt=[]), "prompt"),
        (COMPLETIONS, completion(logprobs=50), "logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ],
)
def test_validation_errors_are_400_naming_the_field(server: LiveServer, path: str, body: dict, param: str) -> None:
    assert_error(post(server, path, body), 400, "invalid_request_error", param)


def test_invalid_json_is_400(server: LiveServer) -> None:
    response = httpx.post(server.base_url + CHAT, content=b'{"model": ', headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_request_error", None)


def test_openai_client_sees_bad_request(server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                                temperature=5)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        (CHAT, chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
        (CHAT, chat(function_call="auto"), "function_call", "unsupported_parameter"),
        (CHAT, chat(audio={"voice": "alloy"}), "audio", "unsupported_parameter"),
        (CHAT, chat(best_of=2), "best_of", "unsupported_parameter"),
        (CHAT, chat(modalities=["text", "audio"]), "modalities", "unsupported_value"),
        (CHAT, chat(tool_choice="required"), "tool_choice", "unsupported_value"),
        (CHAT, chat(tool_choice="auto"), "tool_choice", "unsupported_value"),  # no tools: 400, as OpenAI/vLLM
        (CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "unsupported_value"),
        (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                    tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice.function.name",
         "unsupported_value"),
        (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
         "response_format.json_schema.schema", None),
        (CHAT, chat(response_format={"type": "json_object"}, ignore_eos=True), "ignore_eos", "unsupported_value"),
        (CHAT, chat(seed=2**63), "seed", None),
        (COMPLETIONS, completion(seed=-(2**63) - 1), "seed", None),
        (COMPLETIONS, completion(min_tokens=20, max_tokens=4), "min_tokens", "unsupported_value"),
        (CHAT, chat(top_logprobs=2), "top_logprobs", "unsupported_value"),
        (CHAT, chat(stream_options={"include_usage": True}), "stream_options", "unsupported_value"),
        (CHAT, chat(max_tokens=4, max_completion_tokens=4), "max_tokens", "unsupported_value"),
        (CHAT, chat(chat_template_kwargs={"enable_thinking": True}), "chat_template_kwargs.enable_thinking",
         "unsupported_value"),
        (CHAT, chat(reasoning_effort="none", chat_template_kwargs={"thinking": True}), "reasoning_effort",
         "unsupported_value"),
        (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content[0].type", None),
        (COMPLETIONS, completion(best_of=3), "best_of", "unsupported_value"),
        (COMPLETIONS, completion(suffix="end"), "suffix", "unsupported_parameter"),
    ],
)
def test_unsupported_parameters_are_400_naming_them(server: LiveServer, path: str, body: dict, param: str,
                                                    code: str | None) -> None:
    assert_error(post(server, path, body), 400, "invalid_request_error", param, code)


def test_null_counts_as_not_sent(server: LiveServer) -> None:
    assert post(server, CHAT, chat(functions=None, response_format=None, seed=None)).status_code == 200


def test_out_of_vocabulary_ids_are_400(server: LiveServer) -> None:
    error = assert_error(post(server, CHAT, chat(logit_bias={"999999": 1})), 400, "invalid_request_error",
                         "logit_bias")
    assert "999999" in error["message"] and f"{server.tokenizer.vocab_size} tokens" in error["message"]
    assert_error(post(server, COMPLETIONS, completion(prompt=[1, 2, 999999])), 400, "invalid_request_error", "prompt")
    assert_error(post(server, "/detokenize", {"tokens": [-1]}), 400, "invalid_request_error", "tokens")


def test_chat_format_errors_name_the_message(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    assert_error(post(server, CHAT, chat(messages=messages)), 400, "invalid_request_error", "messages[1].tool_call_id")


# ---- 400: context length, memory ------------------------------------------------------------------------


def test_context_length_exceeded(server: LiveServer) -> None:
    long_text = "word " * 600  # > max_model_len 512 tokens
    error = assert_error(post(server, CHAT, chat(messages=[{"role": "user", "content": long_text}])), 400,
                         "invalid_request_error", "messages", "context_length_exceeded")
    assert "512" in error["message"]
    assert_error(post(server, COMPLETIONS, completion(prompt=list(range(10, 600)))), 400,
                 "invalid_request_error", "prompt", "context_length_exceeded")
    assert_error(post(server, COMPLETIONS, completion(max_tokens=600)), 400,
                 "invalid_request_error", "max_tokens", "context_length_exceeded")
    assert_error(post(server, CHAT, chat(max_tokens=None, max_completion_tokens=510)), 400,
                 "invalid_request_error", "max_tokens", "context_length_exceeded")


def test_request_that_can_never_fit_memory_is_400(tokenizer) -> None:
    # ScriptedRunner caches 1 KiB per token: a 64 KiB budget holds 64 tokens at most.
    with live_server(tokenizer, memory_budget_bytes=64 * 1024) as small:
        assert post(small, COMPLETIONS, completion(max_tokens=8)).status_code == 200
        assert_error(post(small, COMPLETIONS, completion(max_tokens=100)), 400, "invalid_request_error",
                     "max_tokens", "insufficient_memory")


# ---- 404 ------------------------------------------------------------------------------------------------------


def test_unknown_model_is_404(server: LiveServer) -> None:
    for path, body in ((CHAT, chat(model="gpt-4")), (COMPLETIONS, completion(model="gpt-4")),
                       ("/tokenize", {"model": "gpt-4", "prompt": "x"})):
        assert_error(post(server, path, body), 404, "invalid_request_error", "model", "model_not_found")
    assert_error(httpx.get(server.base_url + "/v1/models/gpt-4"), 404, "invalid_request_error", "model",
                 "model_not_found")
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_unknown_route_is_404_and_wrong_method_405(server: LiveServer) -> None:
    assert_error(httpx.get(server.base_url + "/v1/nothing"), 404, "invalid_request_error", None, "not_found")
    assert_error(httpx.get(server.base_url + CHAT), 405, "invalid_request_error", None, "method_not_allowed")


# ---- 401 ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tokenizer) -> Iterator[LiveServer]:
    with live_server(tokenizer, api_keys=["sk-one", "sk-two"]) as live:
        yield live


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-one"},
                                     {"Authorization": "Basic sk-one"}])
@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", CHAT, chat()), ("POST", COMPLETIONS, completion()), ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL_NAME}", None), ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [5]}),
])
def test_missing_or_wrong_api_key_is_401(keyed_server: LiveServer, headers: dict, method: str, path: str,
                                         body: Any) -> None:
    response = httpx.request(method, keyed_server.base_url + path, json=body, headers=headers)
    assert_error(response, 401, "invalid_request_error", None, "invalid_api_key")


def test_right_api_key_passes_and_probes_need_none(keyed_server: LiveServer) -> None:
    for key in ("sk-one", "sk-two"):
        response = keyed_server.client(api_key=key).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert response.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client(api_key="sk-three").models.list()
    for probe in ("/health", "/ready", "/version"):
        assert httpx.get(keyed_server.base_url + probe).status_code == 200


# ---- 413 ------------------------------------------------------------------------------------------------------


def test_oversized_body_is_413(server: LiveServer) -> None:
    big = completion(prompt="x" * (70 * 1024))  # the module server's max_body_bytes is 64 KiB
    assert_error(post(server, COMPLETIONS, big), 413, "invalid_request_error", None, "request_too_large")
    chunked = (json.dumps(big)[i:i + 4096].encode() for i in range(0, len(json.dumps(big)), 4096))
    response = httpx.post(server.base_url + COMPLETIONS, content=chunked, headers={"content-type": "application/json"})
    assert_error(response, 413, "invalid_request_error", None, "request_too_large")
    assert post(server, COMPLETIONS, completion(prompt="x" * 1000)).status_code == 200


# ---- 503 ------------------------------------------------------------------------------------------------------


def _in_background(fn, *args: Any) -> tuple[threading.Thread, list[Any]]:
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(fn(*args)))
    thread.start()
    return thread, results


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_queue_full_is_503_with_retry_after(tokenizer) -> None:
    with live_server(tokenizer, max_num_seqs=1, max_queued_requests=0, step_delay_s=0.01) as busy:
        thread, results = _in_background(post, busy, COMPLETIONS, completion(max_tokens=100))
        _wait_for(lambda: busy.engine.stats().num_running == 1)
        response = post(busy, CHAT, chat())
        assert_error(response, 503, "server_error", None, "queue_full")
        assert response.headers["retry-after"] == "1"
        thread.join()
        assert results[0].status_code == 200  # the admitted request was not disturbed


def test_draining_is_503_and_finishes_in_flight(tokenizer) -> None:
    with live_server(tokenizer, step_delay_s=0.01) as draining:
        thread, results = _in_background(post, draining, COMPLETIONS, completion(max_tokens=50))
        _wait_for(lambda: draining.engine.stats().num_running == 1)
        state = draining.app.state.tessera
        drain, _ = _in_background(asyncio.run, state.drain(10.0))
        _wait_for(lambda: state.is_draining)
        ready = httpx.get(draining.base_url + "/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "draining"}
        assert_error(post(draining, CHAT, chat()), 503, "server_error", None, "service_unavailable")
        thread.join()
        drain.join()
        assert results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 50


def test_loading_is_503() -> None:
    with serving(create_app(Settings())) as base_url:
        ready = httpx.get(base_url + "/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "loading"}
        assert httpx.get(base_url + "/health").status_code == 200
        scrape = httpx.get(base_url + "/metrics")  # Prometheus sees the server (and its settings) while it loads
        assert scrape.status_code == 200 and 'tessera_prefill_chunk_tokens{model_name="tessera-default"}' in scrape.text
        assert_error(post(base_url, CHAT, chat()), 503, "server_error", None, "service_unavailable")
        assert httpx.get(base_url + "/v1/models").json() == {"object": "list", "data": []}


# ---- 500 and errors inside a stream --------------------------------------------------------------------


def test_internal_failure_is_500_and_others_are_unharmed(server: LiveServer) -> None:
    server.runner.fail_marker, server.runner.fail_after_tokens = "explode now", 0
    try:
        response = post(server, CHAT, chat(messages=[{"role": "user", "content": "explode now"}]))
        assert_error(response, 500, "server_error", None, "internal_error")
        streamed = post(server, CHAT, chat(messages=[{"role": "user", "content": "explode now"}], stream=True))
        assert_error(streamed, 500, "server_error", None, "internal_error")  # before the first token: real status
    finally:
        server.runner.fail_marker = None
    assert post(server, CHAT, chat()).status_code == 200
    assert server.engine.stats().is_alive


def test_failure_after_first_token_is_an_sse_error_then_done(server: LiveServer) -> None:
    server.runner.fail_marker, server.runner.fail_after_tokens = "explode later", 3
    try:
        body = chat(messages=[{"role": "user", "content": "explode later"}], max_tokens=20, stream=True)
        with httpx.stream("POST", server.base_url + CHAT, json=body, timeout=30) as response:
            chunks = sse_chunks(response.iter_lines())
    finally:
        server.runner.fail_marker = None
    assert response.status_code == 200
    error = chunks.pop()["error"]  # the last chunk before [DONE]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert any(c["choices"][0]["delta"].get("content") for c in chunks)  # tokens came before the failure
    assert not any(c["choices"][0].get("finish_reason") for c in chunks)
