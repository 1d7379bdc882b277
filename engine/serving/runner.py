"""ModelRunner: executes the scheduler's StepPlan on the V4 model (the `Runner` of engine/serving/protocol.py).

One step = all running decodes plus at most one prefill chunk, run as one flat batch of segments;
then one token is sampled for every decode and for a prefill chunk that completes its prompt.
Owns each request's cache, token history and random stream, keyed by request id.

Decode overlap (engine/serving/decode_overlap.py): after a decode-only step the runner queues the step the
scheduler will most likely plan next on the device before it reads this step's tokens; the next plan takes
it if it is that step (less requests that finished), and undoes it otherwise.
Structured outputs: a request's TokenConstraint mask for this step's token is computed on the host while the
model step evaluates (`mx.async_eval`), so grammar work overlaps the forward pass instead of following it.
Prompt logprobs: a prefill chunk of a request that asked for them runs the lm head on all its rows (only
then), and the chunk's prompt logprobs come back in the StepOutput: no second pass, whatever the chunking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx

from tessera.engine.model.cache import SequenceCache, detached, resume_state, rewind
from tessera.engine.model.config import ModelConfig
from tessera.engine.model.dtypes import dtype_name
from tessera.engine.model.loader import load_model
from tessera.engine.model.memory_plan import attention_call_elements, cache_bytes_at, make_plan, tile_array_elements
from tessera.engine.model.quantized import QuantizedWeight
from tessera.engine.model.deepseek_v4 import PENDING_TOKEN, DeepseekV4, Segment, fill_pending_token

from tessera.engine.serving.decode_overlap import OverlapCounts, QueuedStep, can_queue_ahead
from tessera.engine.serving.prefix_cache import Lineage, PrefixCache, PrefixNode
from tessera.engine.serving.protocol import (
    PrefillChunk,
    PromptLogprob,
    PromptLogprobs,
    SampledToken,
    SamplingParams,
    StepOutput,
    StepPlan,
)
from tessera.engine.serving.sampler import (
    LazySamples, RequestRng, Sample, TokenHistory, ranked_logprobs, read_samples, sample_lazily, token_logprobs,
)
from tessera.engine.model.trace import ForwardTrace


logger = logging.getLogger(__name__)

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
    lineage: Lineage
    prompt_ids: tuple[int, ...]


_Ahead = tuple[LazySamples, ForwardTrace, Callable[[], None]]  # a queued step's samples, trace and undo


def _restorer(seq: _Sequence) -> Callable[[], None]:
    """A function that puts a sequence's cache, its pending prefix state and its random stream back to how
    they are now."""
    state, pending, rng_position = resume_state(seq.cache), seq.lineage.pending, seq.rng.position()

    def restore() -> None:
        rewind(seq.cache, state)
        seq.lineage.pending = pending
        seq.rng.rewind_to(rng_position)

    return restore


def _restorers(seqs: Sequence[_Sequence]) -> Callable[[], None]:
    restores = [_restorer(seq) for seq in seqs]

    def restore_all() -> None:
        for restore in restores:
            restore()

    return restore_all


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV4,
        prefill_chunk: int,
        indexer_tile: int,
        max_context: int | None = None,
        stage_timing_interval: int = 1,
        prefix_cache_bytes: int = 0,
        decode_overlap: bool = True,
    ) -> None:
        """decode_overlap: queue each decode-only step's likely successor before reading its tokens
        (engine/serving/decode_overlap.py)."""
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
        self.decode_overlap = decode_overlap
        self._queued: QueuedStep | None = None  # the decode step queued ahead of its plan, if any
        self.overlap_counts = OverlapCounts()
        self._overlap_events: list[str] = []  # this step's (protocol.OVERLAP_EVENTS)
        # 0 bytes: no prefix cache. Its bytes come out of the memory budget (scheduler.py).
        self.prefix_cache = PrefixCache(model.cfg, model.dtype, prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        # request -> the cache match_prefix restored for it and the node it came from, until a plan adds it
        self._restored: dict[str, tuple[SequenceCache, PrefixNode]] = {}
        self._weights_bytes = sum(w.nbytes for w in model.weights.values())
        self._planned_workspace = make_plan(model.cfg, self.max_context, prefill_chunk, indexer_tile,
                                            dtype_name(model.dtype), _quantized_dense(model)).workspace_bytes

    def set_prefix_cache_bytes(self, capacity_bytes: int) -> None:
        """Size (or turn off, 0) the prefix cache before the first request; the factory knows the budget only
        after the model is loaded."""
        if self._sequences:
            raise RuntimeError("the prefix cache is sized before any request runs")
        self.prefix_cache = PrefixCache(self.model.cfg, self.model.dtype, capacity_bytes) if capacity_bytes > 0 else None

    # ---- Runner protocol -----------------------------------------------------------------------

    def match_prefix(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        """Leading prompt tokens this request starts with from the prefix cache (0: none). Restores them now,
        into a cache of the request's own, so releases in the coming step cannot evict them first."""
        if self.prefix_cache is None:
            return 0
        node = self.prefix_cache.longest_prefix(prompt_ids)
        self.prefix_cache.count_query(len(prompt_ids), node.num_tokens if node else 0)
        if node is None:
            return 0
        self._restored[request_id] = (self.prefix_cache.restore(node, prompt_ids), node)
        return node.num_tokens

    def execute(self, plan: StepPlan) -> StepOutput:
        """Drop the plan's finished requests, set up its new ones, then run its tokens as one batch."""
        self._overlap_events = []
        output = self._execute(plan)
        return replace(output, overlap_events=tuple(self._overlap_events)) if self._overlap_events else output

    def _note(self, event: str) -> None:
        """A decode overlap event of this step (protocol.OVERLAP_EVENTS)."""
        self._overlap_events.append(event)
        self.overlap_counts.note(event)

    def _execute(self, plan: StepPlan) -> StepOutput:
        queued, rows = self._claim_queued(plan)
        if queued is not None:
            return self._run_queued(plan, queued, rows)
        for request_id in plan.finished_request_ids:
            self.release(request_id)
        for new in plan.new_requests:
            self.add_request(new.request_id, new.prompt_ids, new.sampling, new.num_cached_tokens)
        restores = [_restorer(self._sequences[r]) for r in plan.request_ids if r in self._sequences]
        try:
            return self._run(plan)
        except Exception:
            # The Runner contract: a failed step leaves its requests as they were, so the engine can re-run
            # them without the one that fails (engine_loop.EngineLoop._isolate_failure). Sampling state
            # (history, random stream) only moves after a successful forward.
            for restore in restores:
                restore()
            raise

    def _claim_queued(self, plan: StepPlan) -> tuple[QueuedStep | None, tuple[int, ...]]:
        """The step queued ahead and its rows that are `plan`'s decodes, if `plan` is that step (less finished
        requests); otherwise it is undone (before anything else in the plan touches its requests): (None, ())."""
        queued, self._queued = self._queued, None
        if queued is None:
            return None, ()
        rows = queued.rows_for(plan)
        if rows is not None:
            self._note("taken")
            return queued, rows
        queued.undo()
        self._note("undone")
        return None, ()

    def _run_queued(self, plan: StepPlan, queued: QueuedStep, rows: tuple[int, ...]) -> StepOutput:
        """`plan` is the queued step, less the requests it finishes: those are released (their rows stay
        unread); the others' caches hold the step already: read their tokens (queueing the next step)."""
        for request_id in plan.finished_request_ids:
            self.release(request_id)
        try:
            for slot in plan.decodes:  # the tokens it was fed are on the host now
                fill_pending_token(self._sequences[slot.request_id].cache, slot.position, slot.token_id)
            self._save_prefixes(plan)
            sampled = self._read_and_queue(plan, list(plan.request_ids), queued.samples.subset(rows))
        except Exception:
            queued.undo()  # the Runner contract: a failed step leaves its requests as they were
            raise
        return StepOutput(sampled=tuple(sampled), stage_seconds=queued.timer.as_dict())

    def add_filled_request(self, request_id: str, cache: SequenceCache, sampling: SamplingParams) -> None:
        """Set up a request whose cache is already filled (benchmarks: engine/tools/bench_decode.py's
        random caches); its prompt is the cache's tokens."""
        self._sequences[request_id] = _Sequence(cache, sampling, TokenHistory(cache.token_ids), RequestRng(sampling.seed),
                                                Lineage(node=None), tuple(cache.token_ids))

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, num_cached_tokens: int = 0
    ) -> None:
        """Set up one request's cache, history and random stream (a plan's `new_requests` come here); with
        cached tokens, the cache `match_prefix` restored."""
        cache, node = self._restored.pop(request_id, (None, None))
        if num_cached_tokens and (cache is None or cache.num_tokens != num_cached_tokens):
            raise RuntimeError(
                f"{request_id!r}: planned to start at token {num_cached_tokens}, no such prefix restored"
            )
        if not num_cached_tokens:
            cache, node = self.model.new_cache(), None
        lineage = Lineage(node=node)
        self._sequences[request_id] = _Sequence(
            cache, sampling, TokenHistory(prompt_ids), RequestRng(sampling.seed), lineage, tuple(prompt_ids)
        )

    def _run(self, plan: StepPlan) -> StepOutput:
        ids, segments = [], []
        for slot in plan.decodes:
            cache = self._sequences[slot.request_id].cache
            if cache.num_tokens != slot.position:  # the plan and the cache disagree: never run on it
                raise RuntimeError(
                    f"{slot.request_id!r}: the decode is at position {slot.position}, its cache holds {cache.num_tokens}"
                )
            ids.append(slot.request_id)
            segments.append(Segment(cache, [slot.token_id]))
        sampled_ids = list(ids)
        wants_prompt_logprobs = False
        if plan.prefill is not None:
            chunk = plan.prefill
            seq = self._sequences[chunk.request_id]
            cache = seq.cache
            if cache.num_tokens != chunk.start:  # a prefix restore and the scheduler disagree: never run on it
                raise RuntimeError(
                    f"{chunk.request_id!r}: the chunk starts at token {chunk.start}, its cache holds {cache.num_tokens}"
                )
            segments.append(Segment(cache, list(chunk.token_ids)))
            wants_prompt_logprobs = seq.sampling.prompt_logprobs is not None
            if chunk.is_last:
                sampled_ids.append(chunk.request_id)
        if not segments:
            return StepOutput()
        timer = ForwardTrace(stage_sync=self._times_stages(plan))
        # All rows of the prefill only when its request asked for prompt logprobs (a plain bool otherwise).
        all_rows = [False] * len(plan.decodes) + [True] if wants_prompt_logprobs else False
        logits = self.model.forward(segments, tile=self.indexer_tile, all_logits=all_rows, timer=timer)
        self._save_prefixes(plan)
        prompt_logprobs = ()
        if wants_prompt_logprobs:
            prompt_logprobs = (self._prompt_logprobs(plan.prefill, logits[-1]),)
            logits[-1] = logits[-1][-1:]  # the last row is what samples
        rows = logits[: len(sampled_ids)]  # the prefill is last: its row only counts when it samples
        sampled = self._sample(plan, sampled_ids, _joined(rows))
        return StepOutput(sampled=tuple(sampled), prompt_logprobs=prompt_logprobs, stage_seconds=timer.as_dict())

    def _prompt_logprobs(self, chunk: PrefillChunk, logits: mx.array) -> PromptLogprobs:
        """Row j of the chunk's logits [L, V] predicts prompt position chunk.start + j + 1; the last chunk's last
        row predicts the first output token instead (sampled, not a prompt logprob)."""
        seq = self._sequences[chunk.request_id]
        end = min(chunk.start + len(chunk.token_ids), len(seq.prompt_ids) - 1)  # last prompt position predicted
        num_rows = end - chunk.start
        if num_rows <= 0:
            return PromptLogprobs(chunk.request_id, chunk.start + 1, ())
        rows = logits[:num_rows].astype(mx.float32)  # [n, V]
        logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)  # raw distribution, as vLLM's prompt logprobs
        targets = seq.prompt_ids[chunk.start + 1 : end + 1]
        lazy = token_logprobs(logprobs, mx.array(targets), seq.sampling.prompt_logprobs or 0)
        mx.eval(*[array for array in lazy if array is not None])  # only [n] and [n, k] reach the host
        ranked = ranked_logprobs(*lazy)
        entries = [PromptLogprob(int(target), logprob, top) for target, (logprob, top) in zip(targets, ranked)]
        return PromptLogprobs(chunk.request_id, chunk.start + 1, tuple(entries))

    def _times_stages(self, plan: StepPlan) -> bool:
        if plan.prefill is None or not self.stage_timing_interval:
            return False
        self._prefill_steps += 1
        return (self._prefill_steps - 1) % self.stage_timing_interval == 0  # the first one is timed

    def _save_prefixes(self, plan: StepPlan) -> None:
        """A prefill chunk ending on a block is saved now (requests behind it may share it at once); a
        decode's latest block boundary is kept and saved when the request ends (one per request)."""
        if self.prefix_cache is None:
            return
        block = self.prefix_cache.block_tokens
        for slot in plan.decodes:
            seq = self._sequences[slot.request_id]
            if seq.cache.num_tokens % block == 0:
                seq.lineage.pending = detached(resume_state(seq.cache))  # kept until the request ends: its own rows
        if plan.prefill is not None:
            seq = self._sequences[plan.prefill.request_id]
            if seq.cache.num_tokens % block == 0:
                self.prefix_cache.save(seq.cache, seq.lineage)

    def release(self, request_id: str) -> None:
        """Drop one request's state; unknown ids are a no-op (a plan's `finished_request_ids` come here). Its
        last decode block boundary goes into the prefix cache first."""
        self._restored.pop(request_id, None)
        seq = self._sequences.pop(request_id, None)
        if seq is not None:
            if self.prefix_cache is not None and seq.lineage.pending is not None:
                self._save_ended(request_id, seq)
            mx.clear_cache()  # give the freed cache back, so memory returns to idle within the step

    def _save_ended(self, request_id: str, seq: _Sequence) -> None:
        # Releases run at the start of another plan's step: a failed save (the ended request's last step may have
        # failed while its state was still lazy) loses a cache entry, never that step's requests.
        try:
            self.prefix_cache.save(seq.cache, seq.lineage, seq.lineage.pending)
        except Exception:
            logger.exception("saving the prefix of ended request %r failed; it is not cached", request_id)

    def cache_bytes_at(self, num_tokens: int) -> int:
        return cache_bytes_at(self.model.cfg, num_tokens, self.model.dtype.size)

    def memory_snapshot(self) -> dict[str, int]:
        return {
            "weights": self._weights_bytes,
            "kv_cache": sum(s.cache.nbytes for s in self._sequences.values()),
            "prefix_cache": self.prefix_cache.nbytes if self.prefix_cache else 0,
            "planned_workspace": self._planned_workspace,
            "mlx_active": mx.get_active_memory(),
            "mlx_peak": mx.get_peak_memory(),
            "mlx_cache": mx.get_cache_memory(),
        }

    # ---- helpers -------------------------------------------------------------------------------

    def _sample(self, plan: StepPlan, request_ids: list[str], logits: mx.array | None) -> list[SampledToken]:
        if logits is None:
            return []
        seqs = [self._sequences[r] for r in request_ids]
        masks = None
        if any(s.sampling.constraint is not None for s in seqs):
            mx.async_eval(logits)  # the model step runs while the host computes the grammar masks
            masks = [s.sampling.constraint.allowed_mask() if s.sampling.constraint is not None else None for s in seqs]
        lazy = sample_lazily(logits, [s.sampling for s in seqs], [s.history for s in seqs], [s.rng for s in seqs], masks)
        return self._read_and_queue(plan, request_ids, lazy)

    def _read_and_queue(self, plan: StepPlan, request_ids: list[str], lazy: LazySamples) -> list[SampledToken]:
        """The plan's sampled rows on the host, the step after the plan queued on the device first (when it
        may be: decode_overlap.can_queue_ahead)."""
        ahead = self._queue_ahead(plan, lazy)
        samples = read_samples(lazy)  # waits for this step only: the one queued after it keeps running
        if ahead is not None:
            next_samples, timer, undo = ahead
            decodes = tuple((slot.request_id, slot.position + 1) for slot in plan.decodes)
            self._queued = QueuedStep(decodes, tuple(s.token_id for s in samples), next_samples, timer, undo)
        return self._accept(request_ids, samples)

    def _queue_ahead(self, plan: StepPlan, lazy: LazySamples) -> _Ahead | None:
        """Build and queue the decode step after `plan` on `lazy`'s tokens, still on the device -> (its lazy
        samples, its trace, its undo), or None when it may not be queued (or building it failed: then the step
        runs when it is planned, as without the overlap)."""
        seqs = [self._sequences[slot.request_id] for slot in plan.decodes]
        room = all(s.cache.num_tokens < self.max_context for s in seqs)
        if not (self.decode_overlap and can_queue_ahead(plan, [s.sampling for s in seqs], room)):
            return None
        undo = _restorers(seqs)
        try:
            mx.async_eval(lazy.arrays())  # this step first in the device's queue
            timer = ForwardTrace(stage_sync=False)
            segments = [Segment(s.cache, [PENDING_TOKEN]) for s in seqs]
            fed = lazy.tokens  # [B] on the device: this step's samples, not in the histories yet
            (logits,) = self.model.forward(segments, tile=self.indexer_tile, timer=timer, device_token_ids=fed, joined=True)
            next_samples = sample_lazily(logits, [s.sampling for s in seqs], [s.history for s in seqs],
                                         [s.rng for s in seqs], pending=fed)
            mx.async_eval(next_samples.arrays())
        except Exception:
            logger.exception("queueing the next decode step ahead failed; it runs when planned")
            undo()
            self._note("failed")
            return None
        self._note("queued")
        return next_samples, timer, undo

    def _accept(self, request_ids: list[str], samples: list[Sample]) -> list[SampledToken]:
        """The samples are the requests' tokens now: into their histories (and grammars)."""
        seqs = [self._sequences[r] for r in request_ids]
        out = []
        for request_id, seq, s in zip(request_ids, seqs, samples):
            seq.history.append(s.token_id)
            if seq.sampling.constraint is not None:
                seq.sampling.constraint.accept(s.token_id)
            out.append(SampledToken(request_id, s.token_id, s.logprob, s.top_logprobs))
        return out


def _joined(rows: list[mx.array]) -> mx.array | None:
    """The sampled rows as one [B, V] array (no copy for one row, a batch-1 decode)."""
    if not rows:
        return None
    return rows[0] if len(rows) == 1 else mx.concatenate(rows)


def default_compute_dtype() -> str:
    """float32 on CPU (bf16 matmul there runs at a few GFLOP/s), the checkpoint's dtype on a GPU."""
    return "float32" if mx.default_device() == mx.cpu else None


def _quantized_dense(model: DeepseekV4) -> bool:
    """Whether any non-expert projection is held quantized (its prefill steps dequantize it: memory_plan)."""
    return any(isinstance(w, QuantizedWeight) and ".experts." not in name for name, w in model.weights.items())


def build_runner(
    model_dir: Path,
    prefill_chunk: int,
    indexer_tile: int,
    max_context: int | None = None,
    stage_timing_interval: int = 1,
    prefix_cache_bytes: int = 0,
    weights_dtype: str | None = None,
    decode_overlap: bool = True,
) -> ModelRunner:
    """weights_dtype: dequantize a quantized checkpoint's weights to this dtype at load (debugging,
    `tessera serve --weights-dtype`); None computes on them quantized."""
    model = load_model(Path(model_dir), dtype=default_compute_dtype(), weights_dtype=weights_dtype)
    return ModelRunner(model, prefill_chunk, indexer_tile, max_context, stage_timing_interval, prefix_cache_bytes,
                       decode_overlap)
