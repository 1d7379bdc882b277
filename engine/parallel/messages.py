"""What rank 0 tells the other ranks each step, as plain data (JSON bytes, broadcast by the Transport of
engine/parallel/transport.py).

A follower needs no sampling state: only which requests get a cache, which are released, and the step plan
(token ids and their order), which it runs through its layers exactly as rank 0 does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tessera.engine.serving.protocol import DecodeSlot, PrefillChunk, StepPlan


@dataclass(frozen=True)
class StepMessage:
    added: tuple[str, ...] = ()  # the plan's new requests, set up before it runs
    released: tuple[str, ...] = ()  # the plan's finished requests, dropped first
    plan: StepPlan = StepPlan()  # its tokens: decodes and the prefill chunk
    stop: bool = False  # the server is shutting down: exit after this message
    gather_memory: bool = False  # after the step, every rank joins one all_gather of its memory (serving.py)

    @classmethod
    def of(cls, plan: StepPlan, gather_memory: bool = False) -> "StepMessage":
        """What followers need of a plan: ids only for new requests (prompts and sampling stay on rank 0)."""
        return cls(tuple(n.request_id for n in plan.new_requests), plan.finished_request_ids,
                   StepPlan(plan.decodes, plan.prefill), gather_memory=gather_memory)

    def encode(self) -> bytes:
        plan = {"decodes": [[d.request_id, d.token_id, d.position] for d in self.plan.decodes]}
        if self.plan.prefill is not None:
            p = self.plan.prefill
            plan["prefill"] = [p.request_id, list(p.token_ids), p.start, p.is_last]
        return json.dumps({"added": self.added, "released": self.released, "plan": plan, "stop": self.stop,
                           "gather_memory": self.gather_memory}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "StepMessage":
        raw = json.loads(data)
        decodes = tuple(DecodeSlot(r, t, p) for r, t, p in raw["plan"]["decodes"])
        prefill = raw["plan"].get("prefill")
        chunk = None if prefill is None else PrefillChunk(prefill[0], tuple(prefill[1]), prefill[2], prefill[3])
        return cls(tuple(raw["added"]), tuple(raw["released"]), StepPlan(decodes, chunk), raw["stop"],
                   raw["gather_memory"])

