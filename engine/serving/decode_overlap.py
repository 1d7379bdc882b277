"""The decode step queued ahead: step n + 1 runs on the device while the host finishes step n.

A decode step ends with the sampled tokens copied to the host; the scheduler needs them (stop tokens,
lengths, streaming) before it plans the next step, and Python then builds that step's graph while the
device waits. The runner instead builds the step the scheduler will most likely plan next — the same
requests in the same order, each fed the token it just sampled, still on the device
(`DeepseekV4.forward`'s `device_token_ids`) — and queues it (`mx.async_eval`) before it reads step n's
tokens. Python's graph building then runs while the device runs step n, and the device runs step n + 1
while the engine loop posts step n's tokens and schedules. vLLM's "async scheduling" does the same
across its scheduler; here it stays inside the runner, and the scheduler and its plans are unchanged.

When the next plan is the queued step (`QueuedStep.rows_for`), the runner reads its results — also when
the plan only drops requests that finished (a stop token, max_tokens, an abort): their rows are computed
and left unread, the others' are the plan's. Any other plan (a request arrived, a prefill chunk) undoes
it — caches, their prefix state and random streams back as they were — and runs the plan as usual. The
queued step is the step the plan asks for, so the tokens are the same either way; a plan that differs
costs one step of device time spent for nothing. One difference on a GPU: after a finish the others' rows
were computed in a batch one row larger than the plan's, and a GPU row's bits depend on the batch's row
count, so their logprobs can differ in the last bits (on the H200: the same tokens, a logprob 8.5·10⁻⁴
apart; docs/BENCHMARKS.md, "Session 11 on the H200"). Undoing the step instead would make them equal at a
step of device time per finish; any arrival changes a batch's rows as much, so it is not worth that.

The queued step samples before its fed tokens reach the host's token histories: the sampler counts each
row's pending token on the device (penalties, min_tokens; engine/serving/sampler.py `sample_lazily`'s
`pending`), with the same float32 operations as once it is appended. A grammar cannot: its next mask
needs the token on the host, so a step with a structured-output request runs one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tessera.engine.model.trace import ForwardTrace
from tessera.engine.serving.protocol import SamplingParams, StepPlan
from tessera.engine.serving.sampler import LazySamples


@dataclass(frozen=True)
class QueuedStep:
    """A decode step built and queued on the device ahead of its plan."""

    decodes: tuple[tuple[str, int], ...]  # (request id, position of the token it is fed), in batch order
    fed_tokens: tuple[int, ...]  # the tokens it was fed, as the host read them after queueing it
    samples: LazySamples  # its sampled rows, one per decode (lazy, queued)
    timer: ForwardTrace
    undo: Callable[[], None]  # puts every touched cache, prefix state and random stream back

    def rows_for(self, plan: StepPlan) -> tuple[int, ...] | None:
        """The rows of this step that are `plan`'s decodes, in the plan's order, when `plan` is this step less
        requests it finishes (nothing else: no prefill, no new request); otherwise None."""
        if plan.prefill is not None or plan.new_requests or not plan.decodes:
            return None
        finished = set(plan.finished_request_ids)
        kept = tuple(i for i, (request_id, _) in enumerate(self.decodes) if request_id not in finished)
        planned = tuple((slot.request_id, slot.position, slot.token_id) for slot in plan.decodes)
        ours = tuple((*self.decodes[i], self.fed_tokens[i]) for i in kept)
        return kept if planned == ours else None


@dataclass
class OverlapCounts:
    """How the steps queued ahead fared (protocol.OVERLAP_EVENTS): taken by their plan, or undone by a
    different one; building one failed (the step ran when planned instead)."""

    queued: int = 0
    taken: int = 0
    undone: int = 0
    failed: int = 0

    def note(self, event: str) -> None:
        setattr(self, event, getattr(self, event) + 1)


def samples_ahead(params: SamplingParams) -> bool:
    """Whether this request's next token can be sampled before its last one reaches the host: not with a
    grammar (its mask for the next token follows the last one, on the host)."""
    return params.constraint is None


def can_queue_ahead(plan: StepPlan, sampling: Sequence[SamplingParams], room: bool) -> bool:
    """Whether the step after `plan` may be queued now: `plan` is decodes only, each of whose next tokens
    can be sampled ahead (`sampling`, in the plan's order), and every cache has `room` for one more token."""
    return plan.prefill is None and bool(plan.decodes) and room and all(samples_ahead(p) for p in sampling)

