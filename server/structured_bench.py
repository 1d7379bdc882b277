"""Per-token cost of structured-output masking on a real (random-weight) model: `python -m tessera.server.structured_bench`.

Decode steps of one request, free vs under a JSON-schema grammar, in alternating order (A B B A …) in one
process so drift cancels. Also times the grammar work alone (mask + accept per token) and the mask's application
in the sampler. Results as JSON (docs/BENCHMARKS.md, section "Issue 15").
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from tessera.engine.model.tokenizer import Tokenizer
from tessera.engine.serving.protocol import DecodeSlot, PrefillChunk, SamplingParams, StepPlan
from tessera.engine.serving.runner import build_runner
from tessera.engine.tools.make_model import make_model
from tessera.server.structured_output import GrammarCompiler, full_grammar, json_grammar

# Never finishes within the measured steps: the grammar stays active on every token.
LONG_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "tag": {"enum": ["a", "b", "c"]}, "score": {"type": "number"}},
    "required": ["id", "tag", "score"], "additionalProperties": False}, "minItems": 500}


def _decode_run(runner, grammars: GrammarCompiler | None, grammar: str | None, prompt: list[int], steps: int,
                request_id: str) -> tuple[list[float], list[float]]:
    """Seconds per decode step (runner.execute) and per-token grammar seconds (mask + accept, inside execute)."""
    constraint = _Timed(grammars.constraint(grammar)) if grammar is not None else None
    runner.add_request(request_id, prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 1,
                                                          constraint=constraint))
    out = runner.execute(StepPlan(prefill=PrefillChunk(request_id, tuple(prompt), 0, True)))
    token, position, times = out.sampled[0].token_id, len(prompt), []
    for _ in range(steps):
        start = time.perf_counter()
        out = runner.execute(StepPlan(decodes=(DecodeSlot(request_id, token, position),)))
        times.append(time.perf_counter() - start)
        token, position = out.sampled[0].token_id, position + 1
    runner.release(request_id)
    return times, (constraint.seconds if constraint is not None else [])


class _Timed:
    """A TokenConstraint wrapper recording the host time of each mask + accept."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.seconds: list[float] = []
        self._pending = 0.0

    def allowed_mask(self) -> bytes:
        start = time.perf_counter()
        mask = self._inner.allowed_mask()
        self._pending = time.perf_counter() - start
        return mask

    def accept(self, token_id: int) -> None:
        start = time.perf_counter()
        self._inner.accept(token_id)
        self.seconds.append(self._pending + time.perf_counter() - start)


def run(preset: str, steps: int, rounds: int, workdir: Path) -> dict:
    model_dir = make_model(workdir / preset, preset, seed=0, with_tokenizer=True)
    tokenizer = Tokenizer.from_dir(model_dir)
    runner = build_runner(model_dir, prefill_chunk=256, indexer_tile=64)
    grammars = GrammarCompiler(tokenizer)
    grammar = grammars.check(full_grammar(json_grammar(LONG_SCHEMA), False, None), "bench")
    prompt = tokenizer.encode("Write the records as JSON.")
    _decode_run(runner, grammars, grammar, prompt, 8, "warmup")  # compile paths, build the llguidance tokenizer
    arms: dict[str, list[float]] = {"free": [], "grammar": []}
    grammar_host: list[float] = []
    order = []
    for r in range(rounds):
        for arm in (("free", "grammar") if r % 2 == 0 else ("grammar", "free")):  # A B B A
            times, host = _decode_run(runner, grammars, grammar if arm == "grammar" else None, prompt, steps,
                                      f"{arm}-{r}")
            arms[arm].extend(times)
            grammar_host.extend(host)
            order.append(arm)
    free_ms = statistics.median(arms["free"]) * 1e3
    grammar_ms = statistics.median(arms["grammar"]) * 1e3
    return {
        "preset": preset, "steps_per_run": steps, "rounds": rounds, "order": order,
        "vocab_size": tokenizer.vocab_size,
        "decode_step_ms_median": {"free": free_ms, "grammar": grammar_ms},
        "decode_step_ms_mean": {k: statistics.mean(v) * 1e3 for k, v in arms.items()},
        "overhead_ms_per_token_median": grammar_ms - free_ms,
        "overhead_fraction": (grammar_ms - free_ms) / free_ms,
        "grammar_host_us_per_token": {"median": statistics.median(grammar_host) * 1e6,
                                      "p90": sorted(grammar_host)[int(0.9 * len(grammar_host))] * 1e6},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tessera-structured-bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {"machine": f"{platform.machine()} {platform.processor() or ''} {mx.default_device()}",
               "results": [run(p, args.steps, args.rounds, args.workdir) for p in args.presets]}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
