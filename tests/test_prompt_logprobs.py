"""Prompt logprobs come out of the prefill itself, equal whatever the chunking and tiling (issue 15)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tessera.engine.model.deepseek_v4 import Segment
from tessera.engine.model.loader import load_model
from tessera.engine.serving.protocol import PrefillChunk, SamplingParams, StepPlan
from tessera.engine.serving.runner import ModelRunner
from tessera.engine.tools.make_model import make_model

PROMPT = [int(t) for t in np.random.default_rng(3).integers(7, 2048, size=45)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_model(tmp_path_factory.mktemp("plp"), "tiny", seed=4, with_tokenizer=False), dtype="float32")


def _prefill(model, chunk: int, tile: int, top: int = 2):
    """Run PROMPT in chunks of `chunk` rows (tiles of `tile`); return (entries by position, sampled token)."""
    runner = ModelRunner(model, prefill_chunk=max(chunk, tile), indexer_tile=tile)
    runner.add_request("r", PROMPT, SamplingParams(temperature=0.0, prompt_logprobs=top, max_tokens=1))
    entries, sampled = {}, None
    for start in range(0, len(PROMPT), chunk):
        ids = tuple(PROMPT[start : start + chunk])
        out = runner.execute(StepPlan(prefill=PrefillChunk("r", ids, start, start + chunk >= len(PROMPT))))
        for block in out.prompt_logprobs:
            for offset, entry in enumerate(block.entries):
                entries[block.start + offset] = entry
        sampled = out.sampled
    return entries, sampled


def _reference(model) -> np.ndarray:
    """log_softmax of the whole prompt's logits in one untiled pass: row p predicts position p + 1."""
    logits = model.forward([Segment(model.new_cache(), PROMPT)], all_logits=True)[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_every_prompt_token_after_the_first_has_its_logprob_from_one_pass(model):
    entries, sampled = _prefill(model, chunk=len(PROMPT), tile=len(PROMPT))
    reference = _reference(model)
    assert sorted(entries) == list(range(1, len(PROMPT)))  # the first prompt token has none
    for position, entry in entries.items():
        assert entry.token_id == PROMPT[position]
        assert entry.logprob == pytest.approx(reference[position - 1, PROMPT[position]], abs=1e-5)
        best = int(np.argmax(reference[position - 1]))
        assert entry.top_logprobs[0][0] == best and len(entry.top_logprobs) == 2
    assert len(sampled) == 1  # the last row still samples the first output token


@pytest.mark.parametrize("chunk, tile", [(7, 7), (16, 4), (45, 8), (10, 3)])
def test_prompt_logprobs_equal_across_chunk_sizes_and_tiles(model, chunk, tile):
    whole, whole_sampled = _prefill(model, chunk=len(PROMPT), tile=len(PROMPT))
    split, split_sampled = _prefill(model, chunk=chunk, tile=tile)
    assert sorted(split) == sorted(whole)
    for position in whole:
        assert split[position].token_id == whole[position].token_id
        assert split[position].logprob == pytest.approx(whole[position].logprob, abs=1e-4)
        assert [t for t, _ in split[position].top_logprobs] == [t for t, _ in whole[position].top_logprobs]
    assert split_sampled[0].token_id == whole_sampled[0].token_id


def test_tiling_alone_leaves_prompt_logprobs_bit_identical(model):
    untiled, _ = _prefill(model, chunk=16, tile=16)
    tiled, _ = _prefill(model, chunk=16, tile=4)
    assert {p: e.logprob for p, e in tiled.items()} == {p: e.logprob for p, e in untiled.items()}


def test_no_prompt_logprobs_unless_asked(model):
    runner = ModelRunner(model, prefill_chunk=64, indexer_tile=8)
    runner.add_request("r", PROMPT, SamplingParams(temperature=0.0))
    out = runner.execute(StepPlan(prefill=PrefillChunk("r", tuple(PROMPT), 0, True)))
    assert out.prompt_logprobs == () and len(out.sampled) == 1


def test_a_request_asking_for_prompt_logprobs_prefills_every_token_despite_a_cached_prefix():
    """Prompt logprobs come out of the prefill: a prefix-cache hit would leave the cached positions without."""
    from tessera.engine.serving.request import Request
    from tessera.engine.serving.scheduler import Scheduler, SchedulerConfig

    asked = []
    config = SchedulerConfig(prefill_chunk=300, prefix_cache_bytes=1000)
    scheduler = Scheduler(config, lambda n: n, prefix_match=lambda rid, ids: asked.append(rid) or 256)
    scheduler.add(Request("plain", list(range(700)), SamplingParams(max_tokens=4)))
    assert scheduler.schedule().prefill.start == 256
    scheduler.abort("plain")
    scheduler.add(Request("echo", list(range(700)), SamplingParams(max_tokens=4, prompt_logprobs=1)))
    assert scheduler.schedule().prefill.start == 0 and asked == ["plain"]
