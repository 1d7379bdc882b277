"""`tessera check prefix-cache`: a second turn that restores its prefix from the cache gives the same
tokens and log-probabilities as the same request on an engine without the cache.

Runs the real engine (scheduler + ModelRunner, stepped on this thread): turn 1 fills the prefix cache
under one (chunk, tile); then, under another (chunk, tile), each case runs on an engine sharing that
cache and on a cold engine without one. Cases: the conversation's next turn (prefix = turn 1's
prompt and reply, ending off a block boundary), a prompt that diverges exactly on a block boundary,
greedy and seeded, and two requests sharing one prefix at once. On CPU in float32 with a
row-invariant BLAS (not OpenBLAS: docs/BENCHMARKS.md) every difference is exactly zero.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera.engine.model.deepseek_v4 import DeepseekV4
from tessera.engine.model.loader import load_model
from tessera.engine.serving.engine_loop import EngineLoop
from tessera.engine.serving.prefix_blocks import BLOCK_TOKENS
from tessera.engine.serving.protocol import Event, SamplingParams, Token
from tessera.engine.serving.request import Request
from tessera.engine.serving.runner import ModelRunner
from tessera.engine.serving.scheduler import SchedulerConfig
from tessera.engine.tools.replay import random_tokens

CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    num_cached_tokens: int
    ttft_seconds: float  # submission to the first token event


@dataclass(frozen=True)
class CaseResult:
    name: str
    num_prompt_tokens: int
    num_cached_tokens: int
    identical: bool  # same tokens and bit-identical log-probabilities


class Engine:
    """A ModelRunner behind the real scheduler, stepped on the calling thread."""

    def __init__(self, model: DeepseekV4, chunk: int, tile: int, prefix_cache_bytes: int) -> None:
        self.runner = ModelRunner(model, chunk, tile, prefix_cache_bytes=prefix_cache_bytes)
        config = SchedulerConfig(prefill_chunk=chunk, max_num_seqs=4, prefix_cache_bytes=prefix_cache_bytes)
        self._events: dict[str, list[Event]] = {}
        self._first_token_at: dict[str, float] = {}
        self.loop = EngineLoop(self.runner, config, self._on_event)
        self._requests: dict[str, Request] = {}

    def _on_event(self, request_id: str, event: Event) -> None:
        if isinstance(event, Token):
            self._first_token_at.setdefault(request_id, time.perf_counter())
        self._events.setdefault(request_id, []).append(event)

    def run(self, prompts: dict[str, list[int]], sampling: SamplingParams) -> dict[str, Completion]:
        """Submit all prompts at once (they run concurrently), step until done."""
        submitted = time.perf_counter()
        for rid, prompt in prompts.items():
            self._requests[rid] = Request(rid, prompt, sampling)
            self.loop.submit(self._requests[rid])
        self.loop.run_until_idle()
        out = {}
        for rid in prompts:
            tokens = [e for e in self._events.pop(rid) if isinstance(e, Token)]
            cached = self._requests.pop(rid).num_cached_tokens or 0
            ttft = self._first_token_at.pop(rid) - submitted
            out[rid] = Completion(tuple(t.token_id for t in tokens), tuple(t.logprob for t in tokens), cached, ttft)
        return out


def check_model_prefix_cache(
    model: DeepseekV4, fill: tuple[int, int], reuse: tuple[int, int], prompt_tokens: int = 300, max_tokens: int = 40,
    seed: int = 0,
) -> list[CaseResult]:
    vocab = model.cfg.vocab_size
    filler = Engine(model, *fill, prefix_cache_bytes=CACHE_BYTES)
    warm = Engine(model, *reuse, prefix_cache_bytes=CACHE_BYTES)
    warm.runner.prefix_cache = filler.runner.prefix_cache  # one cache, filled and reused under different (C, T)
    cold = Engine(model, *reuse, prefix_cache_bytes=0)

    turn1 = random_tokens(vocab, prompt_tokens, seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    reply = filler.run({"turn1": turn1}, greedy)["turn1"].token_ids
    conversation = turn1 + list(reply) + random_tokens(vocab, 45, seed + 1)
    on_block = turn1[: 2 * BLOCK_TOKENS] + random_tokens(vocab, 30, seed + 2)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=seed + 3, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    cases = [
        ("next turn, greedy", {"a": conversation}, greedy),
        ("next turn, seeded", {"a": conversation}, seeded),
        ("diverges on a block boundary, greedy", {"a": on_block}, greedy),
        ("two requests share one prefix", {"a": conversation, "b": conversation[:-7] + [1, 2, 3]}, seeded),
    ]
    results = []
    for name, prompts, sampling in cases:
        hot, ref = warm.run(prompts, sampling), cold.run(prompts, sampling)
        for rid, prompt in prompts.items():
            h, r = hot[rid], ref[rid]
            same = h.token_ids == r.token_ids and h.logprobs == r.logprobs
            results.append(CaseResult(f"{name} [{rid}]", len(prompt), h.num_cached_tokens, same))
    return results


def check_prefix_cache(
    model_dir: Path, fill: tuple[int, int], reuse: tuple[int, int], prompt_tokens: int, seed: int
) -> dict:
    model = load_model(Path(model_dir), dtype="float32")
    results = check_model_prefix_cache(model, fill, reuse, prompt_tokens, seed=seed)
    return {"fill": list(fill), "reuse": list(reuse), "all_identical": all(r.identical for r in results),
            "cases": [asdict(r) for r in results]}
