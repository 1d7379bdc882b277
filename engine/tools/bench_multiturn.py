"""`tessera bench multiturn`: time to first token of a conversation's second turn with and without the
prefix cache (engine/serving/prefix_cache.py).

Turn 1 is a prompt of ctx - reply - new tokens and a greedy reply; turn 2 re-sends turn 1's prompt and
reply plus `new` tokens (ctx tokens in all), as a chat client does. "cold": turn 2 on an engine without
the cache. "cached": turn 2 on an engine whose cache turn 1 filled (turn 1 is not timed). Each round
builds fresh engines; the two settings alternate their order round by round (cold cached, cached cold,
…) so drift cancels; the mean of rounds is reported, and turn 2's first token must be the same.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.deepseek_v4 import DeepseekV4
from tessera.engine.model.loader import load_model
from tessera.engine.serving.protocol import SamplingParams
from tessera.engine.serving.runner import default_compute_dtype
from tessera.engine.tools.prefix_check import Engine
from tessera.engine.tools.replay import random_tokens

CACHE_BYTES = 8 * 2**30


def bench_multiturn_with_model(
    model: DeepseekV4, ctx: int, new: int, reply: int, chunk: int, tile: int, rounds: int, seed: int = 0
) -> dict:
    vocab = model.cfg.vocab_size
    turn1 = random_tokens(vocab, ctx - new - reply, seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
    first_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    measured: dict[str, list[dict]] = {"cold": [], "cached": []}
    turn2: list[int] | None = None
    for r in range(rounds):
        for arm in ("cold", "cached") if r % 2 == 0 else ("cached", "cold"):
            engine = Engine(model, chunk, tile, prefix_cache_bytes=CACHE_BYTES if arm == "cached" else 0)
            if turn2 is None or arm == "cached":
                answer = engine.run({"turn1": turn1}, greedy)["turn1"].token_ids
                turn2 = turn1 + list(answer) + random_tokens(vocab, new, seed + 1)
            mx.synchronize()
            result = engine.run({"turn2": turn2}, first_token)["turn2"]
            measured[arm].append({"ttft_s": result.ttft_seconds, "cached_tokens": result.num_cached_tokens,
                                  "first_token": result.token_ids[0]})
            del engine
            mx.clear_cache()
    return _summary(measured, ctx, new, reply, chunk, tile, len(turn2))


def _summary(
    measured: dict[str, list[dict]], ctx: int, new: int, reply: int, chunk: int, tile: int, turn2_tokens: int
) -> dict:
    cold = statistics.mean(m["ttft_s"] for m in measured["cold"])
    cached = statistics.mean(m["ttft_s"] for m in measured["cached"])
    first_tokens = {m["first_token"] for runs in measured.values() for m in runs}
    return {
        "ctx": ctx, "turn2_tokens": turn2_tokens, "new_tokens": new, "reply_tokens": reply, "chunk": chunk, "tile": tile,
        "rounds": len(measured["cold"]),
        "cold_ttft_s": cold, "cached_ttft_s": cached, "ratio": cached / cold,
        "cached_tokens": measured["cached"][0]["cached_tokens"],
        "same_first_token": len(first_tokens) == 1,
        "runs": measured,
    }


def bench_multiturn(model_dir: Path, ctx: int, new: int, reply: int, chunk: int, tile: int, rounds: int,
                    dtype: str | None = None) -> dict:
    model = load_model(Path(model_dir), dtype=dtype or default_compute_dtype())
    started = time.perf_counter()
    result = bench_multiturn_with_model(model, ctx, new, reply, chunk, tile, rounds)
    result["wall_s"] = time.perf_counter() - started
    return result
