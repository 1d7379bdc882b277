"""DeepSeek V4 forward pass in MLX over a batch of segments (docs/ARCHITECTURE.md).

A step's tokens are one flat batch: embeddings, hyper-connections, projections and MoE run on all
of them at once; attention splits them back into segments (a prefill chunk, or one decode token of
each running sequence) because each segment has its own cache.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import mlx.core as mx
import numpy as np

from tessera.engine.model.attention import AttentionWeights, DecodeProjections, SegmentSlice, attention
from tessera.engine.model.attention_inputs import with_stacked_inputs
from tessera.engine.model.cache import SequenceCache
from tessera.engine.model.compiled import StepCompiled, step_compile_enabled
from tessera.engine.model.compressor import CompressorWeights
from tessera.engine.model.config import HASH_MOE, ModelConfig
from tessera.engine.model.decode_async import decode_async_mode
from tessera.engine.model.encode_thread import EncodeThread, encode_thread
from tessera.engine.model.hyper import HyperWeights, block_input, expand, expand_pairs, head_input
from tessera.engine.model.moe import MoEWeights, moe, moe_pairs, syncs_host
from tessera.engine.model.rope import StepRope
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.model.weights import held_dtype


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: mx.array
    ffn_norm: mx.array
    attn_hc: HyperWeights
    ffn_hc: HyperWeights
    attn: AttentionWeights
    ffn: MoEWeights

    def prime(self) -> None:
        """Makes the hyper-connections' and the router's lazily cached weight forms (they evaluate when
        first made: never inside a compiled trace)."""
        for hc in (self.attn_hc, self.ffn_hc):
            hc.prime()
        self.ffn.prime()


@dataclass(frozen=True)
class _CompiledLayer:
    """A layer's shape-stable decode parts, compiled with fixed shapes (compiled.StepCompiled)."""

    attention_in: StepCompiled  # streams -> (post, mix_t, normed attention input)
    attention: DecodeProjections  # the projections around the cache-dependent attention
    ffn_half: StepCompiled  # (attn_out, streams, post, mix_t, token_ids) -> streams after the layer


@dataclass(frozen=True)
class Segment:
    """Run `token_ids` as the next tokens of the sequence whose cache is `cache`. A token still on the
    device (`forward`'s `device_token_ids` carries its value) is `PENDING_TOKEN` here."""

    cache: SequenceCache
    token_ids: Sequence[int]


PENDING_TOKEN = -1
"""A segment's host id for a token whose value is still on the device: an overlapped decode step
(engine/serving/decode_overlap.py) runs on the previous step's samples before they reach the host. The
cache's host token list holds it until `fill_pending_token` writes the value in."""


class DeepseekV4:
    def __init__(self, cfg: ModelConfig, weights: dict[str, mx.array], layer_ids: range | None = None) -> None:
        """`layer_ids`: the layers whose weights `weights` holds (None: all). A pipeline stage
        (engine/parallel/) holds a range of them, and the vocabulary tensors only on its first rank."""
        self.cfg = cfg
        self.weights = weights  # canonical (official) names, see engine/model/weights.py
        self.layer_ids = range(cfg.num_hidden_layers) if layer_ids is None else layer_ids
        # The compute dtype, read before the norm weights are held in float32 (`_hold_fixed_dtypes`)
        self.dtype = weights["embed.weight" if "embed.weight" in weights else f"layers.{self.layer_ids[0]}.attn_norm.weight"].dtype
        _hold_fixed_dtypes(weights)
        self.layers = {i: _layer_weights(weights, cfg, i) for i in self.layer_ids}
        self._compiled_layers = {i: _compile_layer(cfg, self.layers[i], i) for i in self.layer_ids}
        self._decoded = False  # a decode step ran here: the lazily evaluated weights are made (`_encode_thread_for`)

    def new_cache(self) -> SequenceCache:
        return SequenceCache.for_model(self.cfg, self.dtype)

    def forward(
        self,
        segments: Sequence[Segment],
        tile: int | None = None,
        all_logits: bool | Sequence[bool] = False,
        timer: ForwardTrace | None = None,
        device_token_ids: mx.array | None = None,
        joined: bool = False,
    ) -> list[mx.array]:
        """Runs every segment's tokens through the model, appending to their caches.

        Returns per segment the logits [L, vocab] (all_logits, or all_logits[i] for segment i: prompt logprobs)
        or [1, vocab] of its last token; the lm head runs only on the rows returned. `joined` (without
        all_logits): one [segments, vocab] array, the rows in segment order, for a caller that samples the
        batch whole (a split the caller would concatenate again costs a copy kernel a segment).
        `tile`: indexer/attention query rows per tile (None: the whole segment, the untiled path).
        `device_token_ids`: the step's tokens [T] int32 as a (lazy) device array, e.g. the previous step's
        samples not yet on the host; the segments then give only the counts (their ids may be PENDING_TOKEN).
        """
        if joined and all_logits is not False:  # refused before any cache is touched
            raise ValueError("joined logits are one row a segment: all_logits must be False")
        timer = timer or ForwardTrace(stage_sync=False)  # nobody reads the times: no stage syncs
        encoder = self._encode_thread_for(segments, timer)
        if encoder:
            # The thread can encode only graphs built on its stream (encode_thread.py): what this step reads
            # and was built elsewhere (the caller's device tokens, a cache edited outside a step) is queued here.
            mx.async_eval(*[a for s in segments for a in s.cache.arrays()], *([] if device_token_ids is None else [device_token_ids]))
        try:
            with mx.stream(encoder.stream) if encoder else contextlib.nullcontext():
                token_ids = step_token_ids(segments) if device_token_ids is None else _checked(device_token_ids, segments)
                streams = self.embed(segments, token_ids)
                streams = self.run_layers(streams, segments, self.layer_ids, tile, timer, token_ids, encoder)
                advance_caches(segments)
                if isinstance(all_logits, bool):
                    logits = self.logits(streams if all_logits else last_rows(streams, segments), segments, all_logits,
                                         split=not joined)
                else:
                    logits = self.logits(streams[mx.array(head_rows(segments, all_logits))], segments, all_logits)
        finally:
            if encoder:  # nothing in flight on the thread once the caller may evaluate again, failed step or not
                encoder.drain()
        if not encoder and all(len(s.token_ids) == 1 for s in segments):
            self._decoded = True
        return logits

    def _encode_thread_for(self, segments: Sequence[Segment], timer: ForwardTrace) -> EncodeThread | None:
        """The encode thread, where this step's layers go to it (decode_async.py, mode "thread"): a decode
        step whose graph building evaluates nothing. That excludes stage-synced traces, a padded MoE (it
        reads its counts) and the first decode step of a model (it makes the lazily evaluated weights
        of its layers and head)."""
        if decode_async_mode() != "thread" or timer.stage_sync or not self._decoded:
            return None
        if any(len(s.token_ids) != 1 for s in segments):
            return None
        if any(syncs_host(len(segments), self.layers[i].ffn, self.cfg.num_experts_per_tok) for i in self.layer_ids):
            return None
        return encode_thread(mx.default_device())

    # The three parts of `forward`, public so that a pipeline stage (engine/parallel/) can run its
    # own layer range between them and pass the streams on.

    def embed(self, segments: Sequence[Segment], token_ids: mx.array | None = None) -> mx.array:
        """The step's tokens -> streams [T, hc, D]: every stream starts as the token's embedding (a
        broadcast view, gone with the first layer's output). token_ids: `step_token_ids(segments)`, if
        the caller has it already."""
        token_ids = step_token_ids(segments) if token_ids is None else token_ids
        embedded = self.weights["embed.weight"][token_ids]  # [T, D]
        return mx.broadcast_to(embedded[:, None, :], (embedded.shape[0], self.cfg.hc_mult, embedded.shape[1]))

    def run_layers(self, streams: mx.array, segments: Sequence[Segment], layer_ids: range, tile: int | None = None,
                   timer: ForwardTrace | None = None, token_ids: mx.array | None = None,
                   encoder: EncodeThread | None = None) -> mx.array:
        """streams [T, hc, D] through `layer_ids` (a subset of this model's), appending to the segments'
        caches of those layers; the caches' token counts move only in `advance_caches`.
        token_ids: `step_token_ids(segments)`, if the caller has it already. encoder: where each decode
        layer goes once built (`forward` decides; the graph is built on its stream)."""
        timer = timer or ForwardTrace(stage_sync=False)
        token_ids = step_token_ids(segments) if token_ids is None else token_ids
        rope = StepRope(step_positions(segments))  # every layer's RoPE tables, built once per step
        rows = _segment_rows(segments)
        longest = max(length for _, length, _, _ in rows)
        tile = tile or longest
        # A decode step's shapes are its batch size: its shape-stable parts replay one trace per size
        # (compiled.py). A stage-synced trace evaluates inside them, so it runs them plain.
        compiled = step_compile_enabled() and longest == 1 and not timer.stage_sync
        for i in layer_ids:
            slices = [SegmentSlice(offset, length, start, cache.layers[i]) for offset, length, start, cache in rows]
            if compiled:
                streams = self._compiled_layer(streams, token_ids, rope, slices, i, tile, timer)
            else:
                streams = self._layer(streams, token_ids, rope, slices, self.layers[i], i, tile, timer)
            if longest > 1:  # evaluating layer by layer bounds a prefill chunk's graph
                timer.boundary("other", streams)
            elif encoder is not None:  # encoded on the thread while Python builds the next layer
                encoder.submit([streams, *[a for s in slices for a in s.cache.arrays()]])
            elif decode_async_mode() != "off" and not timer.stage_sync:
                # Decode: the device may run this layer while Python builds the next (decode_async.py; off by default).
                mx.async_eval(streams, *[a for s in slices for a in s.cache.arrays()])
            else:
                timer.stage("other", streams)
        return streams

    def logits(self, streams: mx.array, segments: Sequence[Segment], all_logits: bool | Sequence[bool],
               split: bool = True) -> list[mx.array]:
        """The last layer's streams -> per segment the logits [L, vocab] (all_logits; streams: all T rows)
        or [1, vocab] of its last token (streams: `last_rows`, one per segment); with one flag per segment,
        streams are `head_rows`. split=False: [all rows' logits] as one array."""
        # One row per segment (no `all_logits`): the rows are a batch size, few shapes to trace.
        compiled = step_compile_enabled() and all_logits is False
        logits = (self._compiled_head if compiled else self._head.logits)(streams)  # [rows, vocab]
        wants = [all_logits] * len(segments) if isinstance(all_logits, bool) else list(all_logits)
        sizes = [len(s.token_ids) if want else 1 for s, want in zip(segments, wants)]
        if len(sizes) == 1 or not split:
            return [logits]
        return mx.split(logits, list(itertools.accumulate(sizes[:-1])), axis=0)  # one node for every segment

    @cached_property
    def _head(self) -> _Head:
        """Made on first use: a pipeline stage holds the head's weights on its last rank only."""
        w, cfg = self.weights, self.cfg
        hc = HyperWeights(w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"])
        return _Head(hc, w["norm.weight"], w["head.weight"], cfg.hc_eps, cfg.rms_norm_eps)

    @cached_property
    def _compiled_head(self) -> StepCompiled:
        return StepCompiled(self._head.logits, prime=self._head.prime)

    def _layer(self, streams, token_ids, rope: StepRope, slices, layer: LayerWeights, i: int, tile: int, timer: ForwardTrace):
        post, mix_t, x = _attention_in(self.cfg, layer, streams)
        attn_out = attention(x, rope, slices, layer.attn, self.cfg, i, tile, timer)
        return _ffn_half(self.cfg, layer, attn_out, streams, post, mix_t, token_ids, timer)

    def _compiled_layer(self, streams, token_ids, rope: StepRope, slices, i: int, tile: int, timer: ForwardTrace):
        """`_layer` of a decode step (one row per segment), its parts around attention compiled
        (`_compile_layer`): the hyper-connections and norm before attention, attention's projections
        (`DecodeProjections`), the FFN half after it; the cache-dependent attention between is built in Python."""
        layer, parts = self.layers[i], self._compiled_layers[i]
        post, mix_t, x = parts.attention_in(streams)
        timer.stage("other", x)
        attn_out = attention(x, rope, slices, layer.attn, self.cfg, i, tile, timer, compiled=parts.attention)
        if syncs_host(streams.shape[0], layer.ffn, self.cfg.num_experts_per_tok):  # a padded MoE: plain
            return _ffn_half(self.cfg, layer, attn_out, streams, post, mix_t, token_ids, timer)
        return timer.stage("moe", parts.ffn_half(attn_out, streams, post, mix_t, token_ids))


@dataclass(frozen=True)
class _Head:
    """The final collapse, norm and vocabulary projection."""

    hc: HyperWeights  # pre mixes only
    norm: mx.array  # [D]
    weight: mx.array  # [vocab, D]
    hc_eps: float
    norm_eps: float

    def logits(self, streams: mx.array) -> mx.array:
        """streams [rows, hc, D] -> logits [rows, vocab]."""
        return head_input(streams, self.hc, self.norm, self.hc_eps, self.norm_eps) @ self.head_t

    @cached_property
    def head_t(self) -> mx.array:
        """[D, vocab]: the head's transposed view, made once (the gemm's operand as `head.weight.T`
        gave it, without a transpose node in every step)."""
        head_t = self.weight.T
        mx.eval(head_t)
        return head_t

    def prime(self) -> None:
        """Makes the lazily cached forms (they evaluate when made: never inside a compiled trace)."""
        self.hc.prime()
        _ = self.head_t


def _attention_in(cfg: ModelConfig, layer: LayerWeights, streams: mx.array):
    """streams [T, hc, D] -> (post [T, hc, 1], mix_t [T, hc, hc], normed attention input [T, D])."""
    return block_input(streams, layer.attn_hc, layer.attn_norm, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)


def _ffn_half(cfg: ModelConfig, layer: LayerWeights, attn_out, streams, post, mix_t, token_ids, timer: ForwardTrace) -> mx.array:
    """attention's output [T, D] expanded into the streams [T, hc, D], then the FFN (MoE) block between
    its collapse and expand -> the layer's output streams [T, hc, D]."""
    streams = expand(attn_out, streams, post, mix_t)
    post, mix_t, ffn_in = block_input(streams, layer.ffn_hc, layer.ffn_norm, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    timer.stage("other", ffn_in)
    args = (ffn_in, token_ids, layer.ffn, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
    if syncs_host(ffn_in.shape[0], layer.ffn, cfg.num_experts_per_tok):  # the padded layout: a prefill chunk
        ffn_out = timer.stage("moe", moe(*args))
        return expand(ffn_out, streams, post, mix_t)
    pairs = moe_pairs(*args)  # its sums are the expand's (one kernel on CUDA decode batches)
    return timer.stage("moe", expand_pairs(pairs, ffn_in, streams, post, mix_t))


def _compile_layer(cfg: ModelConfig, layer: LayerWeights, index: int) -> _CompiledLayer:
    """The layer's pure parts as fixed-shape compiled functions closing over its weights (constants
    of the trace) and the config, not the model (no reference cycle keeps a dropped model's weights);
    their stage marks are inert inside (nothing may evaluate there). index: the layer's number."""
    inert = ForwardTrace(stage_sync=False)
    return _CompiledLayer(
        attention_in=StepCompiled(lambda streams: _attention_in(cfg, layer, streams), prime=layer.prime),
        attention=DecodeProjections(layer.attn, cfg, index),
        ffn_half=StepCompiled(lambda attn_out, streams, post, mix_t, token_ids: _ffn_half(
            cfg, layer, attn_out, streams, post, mix_t, token_ids, inert), prime=layer.prime),
    )


def step_token_ids(segments: Sequence[Segment]) -> mx.array:
    """[T] int32: every segment's tokens, in order (the step's flat batch)."""
    ids = [int(t) for s in segments for t in s.token_ids]
    if PENDING_TOKEN in ids:
        raise ValueError("a segment's token is still on the device: pass forward's device_token_ids")
    return mx.array(ids, dtype=mx.int32)


def _checked(device_token_ids: mx.array, segments: Sequence[Segment]) -> mx.array:
    """The device tokens [T] as int32, checked against the segments' token count."""
    num_tokens = sum(len(s.token_ids) for s in segments)
    if device_token_ids.shape != (num_tokens,):
        raise ValueError(f"device_token_ids has shape {device_token_ids.shape}, the segments hold {num_tokens} tokens")
    return device_token_ids.astype(mx.int32)


def fill_pending_token(cache: SequenceCache, position: int, token_id: int) -> None:
    """Writes a token's host id into the cache's token list once it is known (it was PENDING_TOKEN)."""
    if cache.token_ids[position] != PENDING_TOKEN:
        raise ValueError(f"position {position} holds token {cache.token_ids[position]}, not a pending one")
    cache.token_ids[position] = token_id


def step_positions(segments: Sequence[Segment]) -> mx.array:
    """[T] int32: every token's position in its sequence (the step's flat batch), one array from the host."""
    if all(len(s.token_ids) == 1 for s in segments):  # a decode step: each sequence's next position
        return mx.array([s.cache.num_tokens for s in segments], dtype=mx.int32)
    starts = [np.arange(s.cache.num_tokens, s.cache.num_tokens + len(s.token_ids), dtype=np.int32) for s in segments]
    return mx.array(np.concatenate(starts))


def advance_caches(segments: Sequence[Segment]) -> None:
    """After every layer of this process ran: the segments' tokens are in their caches."""
    for s in segments:
        s.cache.num_tokens += len(s.token_ids)
        s.cache.token_ids.extend(s.token_ids)


def last_rows(streams: mx.array, segments: Sequence[Segment]) -> mx.array:
    """[T, hc, D] -> [len(segments), hc, D]: each segment's last token, the only one sampled."""
    if all(len(s.token_ids) == 1 for s in segments):  # a decode step: every row is a last row
        return streams
    return streams[mx.array(segment_ends(segments))]


def head_rows(segments: Sequence[Segment], wants_all: Sequence[bool]) -> list[int]:
    """Rows the lm head runs on: every row of a segment that wants all its logits, else its last row."""
    rows, offset = [], 0
    for s, want in zip(segments, wants_all):
        count = len(s.token_ids) if want else 1
        rows.extend(range(offset + len(s.token_ids) - count, offset + len(s.token_ids)))
        offset += len(s.token_ids)
    return rows


def segment_ends(segments: Sequence[Segment]) -> list[int]:
    """Row of each segment's last token in the step's flat batch."""
    ends, offset = [], 0
    for s in segments:
        offset += len(s.token_ids)
        ends.append(offset - 1)
    return ends


def _segment_rows(segments: Sequence[Segment]) -> list[tuple[int, int, int, SequenceCache]]:
    """Per segment (offset in the step's flat batch, token count, cached tokens, cache): what each layer's
    SegmentSlice is made of, worked out once per step."""
    out, offset = [], 0
    for s in segments:
        out.append((offset, len(s.token_ids), s.cache.num_tokens, s.cache))
        offset += len(s.token_ids)
    return out


# ---- weights by layer --------------------------------------------------------------------------


def _layer_weights(w: dict[str, mx.array], cfg: ModelConfig, i: int) -> LayerWeights:
    p = f"layers.{i}."
    return LayerWeights(
        attn_norm=w[p + "attn_norm.weight"],
        ffn_norm=w[p + "ffn_norm.weight"],
        attn_hc=HyperWeights(w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"]),
        ffn_hc=HyperWeights(w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"]),
        attn=_attention_weights(w, cfg, i),
        ffn=_moe_weights(w, cfg, i),
    )


def _compressor(w: dict[str, mx.array], prefix: str) -> CompressorWeights:
    return CompressorWeights(w[prefix + "wkv.weight"], w[prefix + "wgate.weight"], w[prefix + "ape"], w[prefix + "norm.weight"])


def _attention_weights(w: dict[str, mx.array], cfg: ModelConfig, i: int) -> AttentionWeights:
    p = f"layers.{i}.attn."
    kind = cfg.compress_ratio(i)
    extra = {}
    if kind:
        extra["compressor"] = _compressor(w, p + "compressor.")
    if cfg.has_indexer(i):
        extra["index_compressor"] = _compressor(w, p + "indexer.compressor.")
        extra["index_wq_b"] = w[p + "indexer.wq_b.weight"]
        extra["index_weights_proj"] = w[p + "indexer.weights_proj.weight"]
    attn, views = with_stacked_inputs(AttentionWeights(
        wq_a=w[p + "wq_a.weight"],
        q_norm=w[p + "q_norm.weight"],
        wq_b=w[p + "wq_b.weight"],
        wkv=w[p + "wkv.weight"],
        kv_norm=w[p + "norm.weight"],
        wo_a=w[p + "wo_a.weight"],
        wo_b=w[p + "wo_b.weight"],
        sinks=w[p + "attn_sink"],
        **extra,
    ))
    for part, view in views.items():  # the checkpoint's arrays are dropped: the stacked copy is the only one
        w[p + _INPUT_PROJECTION_NAMES[part]] = view
    return attn


# attention_inputs.INPUT_PROJECTIONS -> the checkpoint's name under `layers.N.attn.`
_INPUT_PROJECTION_NAMES = {
    "wq_a": "wq_a.weight", "wkv": "wkv.weight", "index_weights_proj": "indexer.weights_proj.weight",
    "compressor.wkv": "compressor.wkv.weight", "compressor.wgate": "compressor.wgate.weight",
    "index_compressor.wkv": "indexer.compressor.wkv.weight", "index_compressor.wgate": "indexer.compressor.wgate.weight",
}


def _moe_weights(w: dict[str, mx.array], cfg: ModelConfig, i: int) -> MoEWeights:
    p = f"layers.{i}.ffn."
    is_hash = cfg.mlp_layer_types[i] == HASH_MOE
    return MoEWeights(
        router=w[p + "gate.weight"],
        correction_bias=None if is_hash else w[p + "gate.bias"],
        tid2eid=w[p + "gate.tid2eid"] if is_hash else None,
        w1=w[p + "experts.w1"],
        w2=w[p + "experts.w2"],
        w3=w[p + "experts.w3"],
        shared_w1=w[p + "shared_experts.w1.weight"],
        shared_w2=w[p + "shared_experts.w2.weight"],
        shared_w3=w[p + "shared_experts.w3.weight"],
    )


def _hold_fixed_dtypes(w: dict[str, mx.array]) -> None:
    """Casts, once and in place in `w`, every tensor the model holds in a fixed dtype (weights.held_dtype: norm
    weights and the router in float32, tid2eid in uint32), instead of a cast node in every step's graph (for the
    bf16 router a [E, D] float32 copy a layer a step; a cast kernel a norm). Exact: every value survives
    (bf16 / fp16 -> float32; expert ids are small non-negative integers)."""
    for name, a in w.items():
        dtype = held_dtype(name)
        if dtype is not None and a.dtype != dtype:
            w[name] = a.astype(dtype)
            mx.eval(w[name])
