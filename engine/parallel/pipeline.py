"""A pipeline stage: this rank's layers of the model, with the hyper-connection streams passed rank to rank.

Every rank sees the same step (the same segments: token ids and cache lengths) and holds the caches of its
own layers only. Rank 0 embeds the tokens and runs its layers; rank r receives the streams [T, hc, D] from
r - 1, runs its layers and sends them on (through a Transport, engine/parallel/transport.py); the last rank sends them back to rank 0 (only each segment's last
row unless every logit row is wanted), which owns the head and returns the logits. The others return None.
The model's own `forward` is the same three parts (embed, run_layers, logits) in one process, so a split
run does the same arithmetic on the same shapes: its logits equal one process's.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from tessera.engine.model.cache import SequenceCache
from tessera.engine.model.deepseek_v4 import DeepseekV4, Segment, advance_caches, last_rows
from tessera.engine.model.trace import ForwardTrace
from tessera.engine.parallel.transport import Transport


class PipelineStage:
    """Quacks like DeepseekV4 where the runner and the replay use it (cfg, dtype, weights, new_cache, forward)."""

    def __init__(self, model: DeepseekV4, group: mx.distributed.Group, transport: Transport) -> None:
        if group.size() < 2:
            raise ValueError("a pipeline needs at least 2 ranks")
        self.model, self.group, self.transport = model, group, transport
        self.rank, self.world = group.rank(), group.size()
        self.cfg, self.dtype, self.weights = model.cfg, model.dtype, model.weights

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def new_cache(self) -> SequenceCache:
        return self.model.new_cache()  # other ranks' layers stay empty: they never get a row here

    def forward(self, segments: Sequence[Segment], tile: int | None = None, all_logits: bool = False,
                timer: ForwardTrace | None = None, logits: bool = True) -> list[mx.array] | None:
        """As DeepseekV4.forward on rank 0; None on the other ranks (they hold no head).

        Every rank walks the hops 0…W-1 in order (hop h: rank h → h + 1, the last back to rank 0): rank r
        receives at hop r - 1, runs its layers and sends at hop r; the collective transport also needs it
        at the hops in between (docs/PARALLEL.md).

        logits=False (every rank must pass the same): a step whose logits nobody reads — a prefill chunk
        before the last. The last rank runs its layers and sends nothing back, and rank 0 returns None at
        once, free to start the next chunk while the later ranks still run this one: in a loop of such
        chunks the ranks overlap (`tessera check parallel --overlap`). Same arithmetic, so the same caches."""
        timer = timer or ForwardTrace(stage_sync=False)  # as DeepseekV4.forward: nobody reads the times (a follower's steps)
        num_tokens = sum(len(s.token_ids) for s in segments)
        streams = self.model.embed(segments) if self.is_first else None
        for hop in range(self.world):
            last_hop = hop == self.world - 1
            rows = len(segments) if last_hop and not all_logits else num_tokens  # what rank 0 samples goes back
            payload = None
            if hop == self.rank:
                payload = self.model.run_layers(streams, segments, self.model.layer_ids, tile, timer)
                if last_hop and not logits:  # nothing goes back: the layers' cache rows are what matter
                    mx.eval(payload)
                elif last_hop and not all_logits:
                    payload = last_rows(payload, segments)
            if last_hop and not logits:
                break
            shape = (rows, self.cfg.hc_mult, self.cfg.hidden_size)  # streams: [rows, hc, D]
            received = self.transport.hop(hop, payload, shape, self.dtype)
            if received is not None:
                streams = timer.boundary("other", received)
        advance_caches(segments)
        if not self.is_first or not logits:
            return None
        return self.model.logits(streams, segments, all_logits)
