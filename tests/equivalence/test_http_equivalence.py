"""Over HTTP on the real (tiny, random) model: a greedy or seeded request gives the same text whether it is sent
alone or concurrently with requests of other lengths, and streaming it gives the same text as not streaming.

The server is `tessera serve`'s own wiring (tessera.server.serve.build_engine + create_app) on a free loopback port,
driven with the openai client. Bit-exact batching needs a row-invariant BLAS (`row_invariant_blas`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import openai
import pytest

from tessera.engine.serving.protocol import StepStats
from tessera.engine.tools.make_model import make_model
from tessera.server.settings import Settings
from tests.equivalence.row_invariant_blas import row_invariant_blas
from tests.server_harness import openai_client, real_server

MAX_TOKENS = 8
OTHER_PROMPTS = [  # other lengths than the probes', prefilling while the probes decode
    "x " * 3,
    "a longer prompt with several more words in it, so it takes a few prefill chunks " * 2,
    "medium sized prompt of a dozen words or so for variety",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("http-eq"), "tiny", seed=6, with_tokenizer=True)


@contextmanager
def tiny_server(model_dir: Path) -> Iterator[tuple[openai.OpenAI, list[StepStats]]]:
    settings = Settings(model=model_dir, served_model_name="tiny", prefill_chunk=16, indexer_tile=8,
                        max_context=2048, max_num_seqs=8)
    with real_server(settings) as (base_url, served):
        steps: list[StepStats] = []
        served.engine.subscribe(steps.append)  # the engine is idle until the first request
        yield openai_client(base_url, timeout=300), steps


PROBES = {
    "greedy chat": dict(kind="chat", prompt="hello there, how are you", temperature=0.0),
    "seeded chat": dict(kind="chat", prompt="tell me a story", temperature=1.0, seed=1234),
    "seeded completion": dict(kind="completion", prompt="once upon a time", temperature=0.9, seed=99),
    "other seed": dict(kind="completion", prompt="once upon a time", temperature=0.9, seed=100),
}


def ask(client: openai.OpenAI, kind: str, prompt: str, stream: bool = False, **sampling) -> str:
    common = dict(model="tiny", max_tokens=MAX_TOKENS, stream=stream, **sampling)
    if kind == "chat":
        reply = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        if stream:
            return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
        return reply.choices[0].message.content
    reply = client.completions.create(prompt=prompt, **common)
    if stream:
        return "".join(chunk.choices[0].text for chunk in reply if chunk.choices)
    return reply.choices[0].text


@row_invariant_blas
def test_greedy_and_seeded_requests_give_the_same_text_alone_and_concurrently(model_dir):
    with tiny_server(model_dir) as (client, steps):
        alone = {name: ask(client, **probe) for name, probe in PROBES.items()}
        steps.clear()
        with ThreadPoolExecutor(len(PROBES) + len(OTHER_PROMPTS)) as pool:
            others = [pool.submit(ask, client, "completion", p) for p in OTHER_PROMPTS]
            together = {name: pool.submit(ask, client, **probe) for name, probe in PROBES.items()}
            together = {name: future.result() for name, future in together.items()}
            assert all(other.result() is not None for other in others)
    assert any(s.num_decode_tokens >= 2 for s in steps), "the concurrent requests never shared a step"
    assert together == alone
    assert alone["seeded completion"] != alone["other seed"], "a different seed gave the same text"
    assert len(set(alone.values())) == len(alone)  # real, distinct outputs, not one constant string


@row_invariant_blas
def test_streamed_text_equals_the_whole_reply(model_dir):
    with tiny_server(model_dir) as (client, _):
        for name, probe in PROBES.items():
            assert ask(client, stream=True, **probe) == ask(client, **probe), name
