"""`tessera serve --model DIR` on a checkpoint in DeepSeek's official FP8/FP4 format, over HTTP: it serves,
computing on the quantized weights, and `--weights-dtype bfloat16|float32` (weights dequantized at load, for
debugging) gives the same greedy text with logprobs within 1e-4 while holding more weight bytes.

The server is `tessera serve`'s own wiring: flags parsed by the CLI parser into Settings, then
tessera.server.serve.build_engine + create_app on a free loopback port, driven with the openai client.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.engine.tools.make_model import make_model
from tessera.server.cli import build_parser, settings_from_args
from tests.server_harness import openai_client, real_server

LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["hello there, how are you", "once upon a time in a land far away, a long prompt of several chunks"]


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("official-serve"), "tiny", seed=7, with_tokenizer=True, fmt="official")


@contextmanager
def official_server(model_dir: Path, *flags: str) -> Iterator[tuple[openai.OpenAI, str]]:
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--served-model-name", "v4-official",
                                      "--prefill-chunk", "16", "--indexer-tile", "8", "--max-context", "2048", *flags])
    with real_server(settings_from_args(args)) as (base_url, _):
        yield openai_client(base_url, timeout=300), base_url


def greedy(client: openai.OpenAI, prompt: str) -> tuple[str, list[float]]:
    reply = client.completions.create(model="v4-official", prompt=prompt, max_tokens=8, temperature=0.0, logprobs=0)
    choice = reply.choices[0]
    return choice.text, list(choice.logprobs.token_logprobs)


def weight_bytes(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "tessera_memory_bytes" and s.labels.get("kind") == "weights")


def serve_and_ask(model_dir: Path, *flags: str) -> tuple[list[tuple[str, list[float]]], float]:
    with official_server(model_dir, *flags) as (client, base_url):
        assert [m.id for m in client.models.list().data] == ["v4-official"]
        replies = [greedy(client, p) for p in PROMPTS]
        return replies, weight_bytes(base_url)


def test_official_checkpoint_serves_and_dequantized_weights_give_the_same_greedy_tokens(official_dir):
    quantized, quantized_bytes = serve_and_ask(official_dir)
    for text, logprobs in quantized:
        assert len(logprobs) == 8 and all(lp <= 0.0 for lp in logprobs)
    assert len({text for text, _ in quantized}) == len(PROMPTS)  # real, prompt-dependent outputs
    for dtype in ("float32", "bfloat16"):
        dense, dense_bytes = serve_and_ask(official_dir, "--weights-dtype", dtype)
        # dequantized at load: FP8 dense + FP4 experts become float32 on the CPU (4-8x their bytes; the
        # tiny model's embedding, head and compressors, float in both, make the whole ~1.4x)
        assert dense_bytes > 1.3 * quantized_bytes, dtype
        for (text_q, lp_q), (text_d, lp_d) in zip(quantized, dense):
            assert text_d == text_q, dtype
            assert max(abs(a - b) for a, b in zip(lp_q, lp_d)) <= LOGPROB_TOLERANCE, dtype
