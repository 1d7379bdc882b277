"""ModelRunner: executes the scheduler's StepPlan on the V4 model (the `Runner` of engine/serving/protocol.py).

One step = all running decodes plus at most one prefill chunk, run as one flat batch of segments;
then one token is sampled for every decode and for a prefill chunk that completes its prompt.
Owns each request's cache, token history and random stream, keyed by request id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from engine.model.cache import SequenceCache
from engine.model.config import ModelConfig
from engine.model.dtypes import dtype_name
from engine.model.loader import load_model
from engine.model.memory_plan import attention_call_elements, cache_bytes_at, make_plan, tile_array_elements
from engine.model.deepseek_v4 import DeepseekV4, Segment
from engine.serving.protocol import SampledToken, SamplingParams, StepOutput, StepPlan
from engine.serving.sampler import RequestRng, TokenHistory, sample
from engine.model.trace import ForwardTrace


GPU_MAX_SORT_ROWS = 65535
GPU_MAX_ARRAY_ELEMENTS = 2**31 - 1


def gpu_limit_errors(cfg: ModelConfig, prefill_chunk: int, indexer_tile: int, max_context: int) -> list[str]:
    """Settings MLX's CUDA build cannot run, each with the reason (empty: fine)."""
    problems = []
    if prefill_chunk > GPU_MAX_SORT_ROWS:
        problems.append(f"prefill_chunk ({prefill_chunk}) must be ≤ {GPU_MAX_SORT_ROWS} on the GPU: MLX's GPU "
                        "sorts (MoE routing) reject more rows in one call")
    tile_elements = tile_array_elements(cfg, max_context, indexer_tile)
    if tile_elements > GPU_MAX_ARRAY_ELEMENTS:
        problems.append(f"indexer_tile ({indexer_tile}) is too large for max_context {max_context} on the GPU: a "
                        f"tile's indexer scores or gathered rows would have {tile_elements:,} elements, more than "
                        f"MLX's CUDA kernels index ({GPU_MAX_ARRAY_ELEMENTS:,}); use a smaller tile")
    # Attention logits exist one ATTENTION_ROWS block per call whatever the tile: the largest is one
    # block's over the widest layer's rows (HCA at max_context).
    logits = attention_call_elements(cfg, max_context)
    if logits > GPU_MAX_ARRAY_ELEMENTS:
        problems.append(f"max_context ({max_context}) is too large for this model on the GPU: one attention "
                        f"block's logits would have {logits:,} elements, more than MLX's CUDA kernels index "
                        f"({GPU_MAX_ARRAY_ELEMENTS:,}; measured: an illegal memory access); use a smaller max_context")
    return problems


@dataclass
class _Sequence:
    cache: SequenceCache
    sampling: SamplingParams
    history: TokenHistory
    rng: RequestRng


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV4,
        prefill_chunk: int,
        indexer_tile: int,
        max_context: int | None = None,
        stage_timing_interval: int = 1,
    ) -> None:
        if not 1 <= indexer_tile <= prefill_chunk:
            raise ValueError(f"indexer_tile ({indexer_tile}) must be between 1 and prefill_chunk ({prefill_chunk})")
        self.max_context = max_context or model.cfg.max_position_embeddings
        if mx.default_device() == mx.gpu:
            problems = gpu_limit_errors(model.cfg, prefill_chunk, indexer_tile, self.max_context)
            if problems:
                raise ValueError("; ".join(problems))
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.indexer_tile = indexer_tile
        # Stage times need a sync per stage (costly on a GPU): one prefill step in this many pays
        # for them (0: none); decode-only steps never do.
        self.stage_timing_interval = stage_timing_interval
        self._prefill_steps = 0
        self._sequences: dict[str, _Sequence] = {}
        self._weights_bytes = sum(w.nbytes for w in model.weights.values())
        self._planned_workspace = make_plan(model.cfg, self.max_context, prefill_chunk, indexer_tile, dtype_name(model.dtype)).workspace_bytes

    # ---- Runner protocol -----------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput:
        """Drop the plan's finished requests, set up its new ones, then run its tokens as one batch."""
        for request_id in plan.finished_request_ids:
            self.release(request_id)
        for new in plan.new_requests:
            self.add_request(new.request_id, new.prompt_ids, new.sampling)
        return self._run(plan)

    def add_request(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Set up one request's cache, history and random stream (a plan's `new_requests` come here)."""
        self._sequences[request_id] = _Sequence(self.model.new_cache(), sampling, TokenHistory(prompt_ids), RequestRng(sampling.seed))

    def _run(self, plan: StepPlan) -> StepOutput:
        ids, segments = [], []
        for slot in plan.decodes:
            ids.append(slot.request_id)
            segments.append(Segment(self._sequences[slot.request_id].cache, [slot.token_id]))
        sampled_ids = list(ids)
        if plan.prefill is not None:
            chunk = plan.prefill
            segments.append(Segment(self._sequences[chunk.request_id].cache, list(chunk.token_ids)))
            if chunk.is_last:
                sampled_ids.append(chunk.request_id)
        if not segments:
            return StepOutput()
        timer = ForwardTrace(stage_sync=self._times_stages(plan))
        logits = self.model.forward(segments, tile=self.indexer_tile, timer=timer)
        rows = logits[: len(sampled_ids)]  # the prefill is last: its row only counts when it samples
        sampled = self._sample(sampled_ids, mx.concatenate(rows) if rows else None)
        return StepOutput(sampled=tuple(sampled), stage_seconds=timer.as_dict())

    def _times_stages(self, plan: StepPlan) -> bool:
        if plan.prefill is None or not self.stage_timing_interval:
            return False
        self._prefill_steps += 1
        return (self._prefill_steps - 1) % self.stage_timing_interval == 0  # the first one is timed

    def release(self, request_id: str) -> None:
        """Drop one request's state; unknown ids are a no-op (a plan's `finished_request_ids` come here)."""
        if self._sequences.pop(request_id, None) is not None:
            mx.clear_cache()  # give the freed cache back, so memory returns to idle within the step

    def cache_bytes_at(self, num_tokens: int) -> int:
        return cache_bytes_at(self.model.cfg, num_tokens, self.model.dtype.size)

    def memory_snapshot(self) -> dict[str, int]:
        return {
            "weights": self._weights_bytes,
            "kv_cache": sum(s.cache.nbytes for s in self._sequences.values()),
            "planned_workspace": self._planned_workspace,
            "mlx_active": mx.get_active_memory(),
            "mlx_peak": mx.get_peak_memory(),
            "mlx_cache": mx.get_cache_memory(),
        }

    # ---- helpers -------------------------------------------------------------------------------

    def _sample(self, request_ids: list[str], logits: mx.array | None) -> list[SampledToken]:
        if logits is None:
            return []
        seqs = [self._sequences[r] for r in request_ids]
        samples = sample(logits, [s.sampling for s in seqs], [s.history for s in seqs], [s.rng for s in seqs])
        out = []
        for request_id, seq, s in zip(request_ids, seqs, samples):
            seq.history.append(s.token_id)
            out.append(SampledToken(request_id, s.token_id, s.logprob, s.top_logprobs))
        return out


def default_compute_dtype() -> str:
    """float32 on CPU (bf16 matmul there runs at a few GFLOP/s), the checkpoint's dtype on a GPU."""
    return "float32" if mx.default_device() == mx.cpu else None


def build_runner(
    model_dir: Path,
    prefill_chunk: int,
    indexer_tile: int,
    max_context: int | None = None,
    stage_timing_interval: int = 1,
) -> ModelRunner:
    model = load_model(Path(model_dir), dtype=default_compute_dtype())
    return ModelRunner(model, prefill_chunk, indexer_tile, max_context, stage_timing_interval)
