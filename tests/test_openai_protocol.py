"""OpenAI wire details real clients index (issue 15): nulls in stream chunks, completions logprobs, echo with
prompt logprobs, SDK no-op fields, vLLM extensions, CORS preflight, 4xx counted by reason. Scripted runner."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from server_harness import MODEL_NAME, LiveServer, live_server, sse_chunks
from tests.support.utf8 import is_partial_utf8


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[LiveServer]:
    with live_server(tokenizer, api_keys=["sekret"], allowed_origins=["https://app.example"]) as live:
        yield live


AUTH = {"Authorization": "Bearer sekret"}


def post(server: LiveServer, path: str, body: dict[str, Any], headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers if headers is not None else AUTH, timeout=30)


def stream_chunks(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, headers=AUTH,
                      timeout=30) as response:
        assert response.status_code == 200, response.read()
        return sse_chunks(response.iter_lines())


def chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], **fields}


def test_chat_stream_chunks_carry_null_keys_as_openai_does(server: LiveServer) -> None:
    server.runner.script("nulls please", server.text_tokens("Hi there"))
    chunks = stream_chunks(server, "/v1/chat/completions",
                           chat("nulls please", stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        assert "usage" in chunk and chunk["usage"] is None  # include_usage: the key on every chunk
        for choice in chunk["choices"]:
            assert "finish_reason" in choice and "logprobs" in choice
            assert None not in choice["delta"].values()  # unset delta fields are left out, as OpenAI does
    assert [c["finish_reason"] for k in chunks for c in k["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    plain = stream_chunks(server, "/v1/chat/completions", chat("nulls please"))
    assert all("usage" not in chunk for chunk in plain)


def test_continuous_usage_stats_puts_usage_on_every_chunk(server: LiveServer) -> None:
    server.runner.script("count as you go", server.text_tokens("one two three"))
    chunks = stream_chunks(server, "/v1/completions", {
        "model": MODEL_NAME, "prompt": "count as you go", "max_tokens": 8,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(chunk["usage"] is not None for chunk in chunks)
    completions = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert completions == sorted(completions) and completions[-1] > completions[0]
    for chunk in chunks[:-1]:
        assert all("finish_reason" in c and "logprobs" in c for c in chunk["choices"])


def test_completion_top_logprobs_include_the_sampled_token_and_keep_partial_bytes_apart(server: LiveServer) -> None:
    tokenizer = server.tokenizer
    partial = [t for t in range(tokenizer.vocab_size) if is_partial_utf8(tokenizer.token_bytes(t))]
    server.runner.script("partial bytes", partial[:6] + [tokenizer.eos_token_id])
    response = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "partial bytes", "max_tokens": 6,
                                                 "logprobs": 0}).json()
    logprobs = response["choices"][0]["logprobs"]
    for name, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert name.startswith("bytes:\\x") and list(top) == [name]  # logprobs 0: just the sampled token
    assert len(set(logprobs["tokens"])) == 6  # six distinct tokens, six distinct names
    # The scripted runner's alternatives are the next ids, so with 3 asked the sampled token is a 4th entry.
    response = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "partial bytes", "max_tokens": 6,
                                                 "logprobs": 3}).json()
    for name, top in zip(response["choices"][0]["logprobs"]["tokens"], response["choices"][0]["logprobs"]["top_logprobs"]):
        assert name in top and len(top) in (3, 4)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_returns_prompt_logprobs_first(server: LiveServer, stream: bool) -> None:
    server.runner.script("echo me back", server.text_tokens("ok", end=False))
    body = {"model": MODEL_NAME, "prompt": "echo me back", "max_tokens": 1, "logprobs": 2, "echo": True}
    prompt_ids = [server.tokenizer.bos_token_id] + server.tokenizer.encode("echo me back")
    if stream:
        chunks = stream_chunks(server, "/v1/completions", body)
        parts = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(p["text"] for p in parts)
        merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        for part in parts:
            for key in merged:
                merged[key] += (part["logprobs"] or {}).get(key, [])
        logprobs = merged
    else:
        choice = post(server, "/v1/completions", body).json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    assert text.startswith("echo me back")
    num_prompt = len(prompt_ids)
    assert len(logprobs["tokens"]) == num_prompt + 1  # every prompt token, then the generated one
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    # The scripted runner's prompt logprob of position p is -p/10.
    assert logprobs["token_logprobs"][1:num_prompt] == pytest.approx([-p / 10 for p in range(1, num_prompt)])
    assert all(len(top) in (2, 3) for top in logprobs["top_logprobs"][1:])


def test_sdk_no_op_fields_are_accepted(server: LiveServer) -> None:
    response = post(server, "/v1/chat/completions", chat(
        "no-op fields", max_tokens=2, store=False, metadata={"k": "v"}, service_tier="auto", user="u1",
        prompt_cache_key="abc", verbosity="low", safety_identifier="s1"))
    assert response.status_code == 200, response.text


def test_vllm_extensions_reach_the_engine(server: LiveServer) -> None:
    response = post(server, "/v1/chat/completions", chat("extensions", max_tokens=6, min_tokens=3, top_k=5,
                                                         min_p=0.1, repetition_penalty=1.2, ignore_eos=False))
    assert response.status_code == 200, response.text
    [request_id] = server.runner.requests_with("extensions")
    sampling = server.runner.sampling_by_id[request_id]
    assert (sampling.min_tokens, sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (3, 5, 0.1, 1.2)
    assert sampling.stop_token_ids == (server.tokenizer.eos_token_id,)  # what min_tokens masks


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(server: LiveServer) -> None:
    special = server.tokenizer.id_of("<｜User｜>")
    server.runner.script("special kept", [special] + server.text_tokens("x"))
    kept = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "special kept", "max_tokens": 4,
                                            "skip_special_tokens": False}).json()
    dropped = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "special kept", "max_tokens": 4}).json()
    assert kept["choices"][0]["text"] == "<｜User｜>x" and dropped["choices"][0]["text"] == "x"


def test_cors_preflight_is_answered_before_the_key_check(server: LiveServer) -> None:
    response = httpx.options(server.base_url + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, timeout=10)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    denied = httpx.post(server.base_url + "/v1/models", headers={"Origin": "https://app.example"}, timeout=10)
    assert denied.status_code in (401, 405)
    assert denied.headers.get("access-control-allow-origin") == "https://app.example"  # errors readable too
    other = httpx.options(server.base_url + "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}, timeout=10)
    assert "access-control-allow-origin" not in other.headers


def test_every_4xx_is_counted_by_reason(server: LiveServer) -> None:
    def count(status: str, reason: str) -> float:
        return server.scrape().get(("tessera_client_errors_total", frozenset(
            {("model_name", MODEL_NAME), ("status", status), ("reason", reason)})), 0.0)

    before = (count("400", "unsupported_parameter"), count("401", "invalid_api_key"), count("404", "model_not_found"))
    post(server, "/v1/chat/completions", chat("x", frobnicate=1))
    post(server, "/v1/chat/completions", chat("x"), headers={})
    post(server, "/v1/chat/completions", {**chat("x"), "model": "nope"})
    after = (count("400", "unsupported_parameter"), count("401", "invalid_api_key"), count("404", "model_not_found"))
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]


def test_every_completion_object_and_chunk_carries_one_system_fingerprint(server: LiveServer) -> None:
    # OpenAI sends `system_fingerprint` on chat.completion(.chunk) and text_completion; llama.cpp's and vLLM's
    # suites read the key directly (KeyError before).
    server.runner.script("fingerprint", server.text_tokens("a b c"))
    bodies = [post(server, "/v1/chat/completions", chat("fingerprint")).json(),
              post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "fingerprint", "max_tokens": 4}).json()]
    bodies += stream_chunks(server, "/v1/chat/completions", chat("fingerprint", stream_options={"include_usage": True}))
    bodies += stream_chunks(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "fingerprint", "max_tokens": 4})
    fingerprints = {body["system_fingerprint"] for body in bodies}
    assert len(fingerprints) == 1
    (fingerprint,) = fingerprints
    assert isinstance(fingerprint, str) and fingerprint.startswith("fp_") and len(fingerprint) == 13


def test_system_fingerprint_changes_with_the_checkpoint() -> None:
    from tessera.server.version import system_fingerprint

    assert system_fingerprint("/models/a") == system_fingerprint("/models/a")
    assert system_fingerprint("/models/a") != system_fingerprint("/models/b")


def test_stop_token_ids_end_the_answer_before_that_token(server: LiveServer) -> None:
    # vLLM's extension (its suite sends it through the openai SDK's extra_body); OpenAI has no equivalent.
    tokens = server.text_tokens("alpha beta gamma", end=False)
    stop_at = tokens[2]
    server.runner.script("stop ids", tokens)
    body = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "stop ids", "max_tokens": len(tokens),
                                            "stop_token_ids": [stop_at]}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == server.tokenizer.decode(tokens[:2])  # the stop token is not in the text
    assert body["usage"]["completion_tokens"] == 3  # but it was generated
    free = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "stop ids", "max_tokens": len(tokens)})
    assert free.json()["choices"][0]["text"] == server.tokenizer.decode(tokens)


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_stop_token_ids_outside_the_vocabulary_are_400(server: LiveServer, bad: int) -> None:
    response = post(server, "/v1/chat/completions", chat("bad stop ids", stop_token_ids=[bad]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids" and str(bad) in error["message"]
