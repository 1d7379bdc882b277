"""The scheduler without a model: its plans run on a ScriptedRunner, which checks that prefill chunks continue
the prompt and decodes feed the right position, so every test here also checks those invariants."""

from __future__ import annotations

import random

import pytest

from tests.support.fake_runner import ScriptedRunner
from tessera.engine.serving.protocol import Done, Error, Progress, SamplingParams, StepPlan, Token
from tessera.engine.serving.request import Request
from tessera.engine.serving.scheduler import AdmissionError, RequestEvent, Scheduler, SchedulerConfig

BYTES_PER_TOKEN = 10


class Driver:
    """schedule -> execute -> postprocess, like the engine loop, on the test's thread."""

    def __init__(self, eos_token_ids=(), scripts=None, **config):
        self.runner = ScriptedRunner(scripts=scripts or {}, bytes_per_token=BYTES_PER_TOKEN)
        self.scheduler = Scheduler(
            SchedulerConfig(**config), self.runner.cache_bytes_at, eos_token_ids=eos_token_ids
        )
        self.plans: list[StepPlan] = []

    def add(self, request_id: str, num_prompt_tokens: int = 4, **sampling) -> Request:
        request = Request(request_id, tuple(range(1, num_prompt_tokens + 1)), SamplingParams(**sampling))
        self.scheduler.add(request)
        return request

    def schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        return plan

    def finish_step(self, plan: StepPlan) -> list[RequestEvent]:
        # The runner sets up and releases requests as the plan says; ScriptedRunner refuses a request that
        # runs before it was added or after it was released, and a release of one it does not hold.
        return self.scheduler.postprocess(plan, self.runner.execute(plan))

    def step(self) -> list[RequestEvent]:
        return self.finish_step(self.schedule())

    def run_until_idle(self, max_steps: int = 100_000) -> list[RequestEvent]:
        events: list[RequestEvent] = []
        for _ in range(max_steps):
            if not self.scheduler.has_work:
                return events
            events += self.step()
        raise AssertionError("the scheduler never drained")


def events_of(events: list[RequestEvent], request_id: str) -> list:
    return [event for request, event in events if request.request_id == request_id]


# ---- the token budget and decode cadence ---------------------------------------------------------------


def test_token_budget_is_never_exceeded_and_every_request_completes():
    rng = random.Random(0)
    driver = Driver(prefill_chunk=64, max_num_seqs=8)
    max_tokens = {}
    for i in range(20):
        max_tokens[f"r{i}"] = rng.randint(1, 40)
        driver.add(f"r{i}", rng.randint(1, 300), max_tokens=max_tokens[f"r{i}"])

    events = driver.run_until_idle()

    for plan in driver.plans:
        assert 0 < plan.num_tokens <= 64
        assert len(plan.decodes) <= 8
        assert len({slot.request_id for slot in plan.decodes}) == len(plan.decodes)
    for request_id, num_tokens in max_tokens.items():
        request_events = events_of(events, request_id)
        assert sum(isinstance(e, Token) for e in request_events) == num_tokens
        assert request_events[-1] == Done("length", request_events[-1].num_prompt_tokens, num_tokens)


def test_prefill_chunk_fills_the_budget_left_by_decodes():
    driver = Driver(prefill_chunk=16, max_num_seqs=4)
    for i in range(3):
        driver.add(f"short{i}", 2, max_tokens=50)
    driver.add("long", 100, max_tokens=5)
    driver.run_until_idle()
    for plan in driver.plans:
        if plan.prefill is not None and not plan.prefill.is_last:
            assert plan.num_tokens == 16  # a chunk that does not finish its prompt takes all that is left


def test_running_request_decodes_every_step_while_a_100k_prompt_prefills():
    driver = Driver(prefill_chunk=512, max_num_seqs=4)
    driver.add("chat", 10, max_tokens=100_000)
    while not driver.scheduler.get("chat").is_prefill_done:
        driver.step()
    driver.add("book", 100_000, max_tokens=1)

    num_steps = 0
    while "book" in driver.scheduler.request_ids:
        plan = driver.schedule()
        events = driver.finish_step(plan)
        num_steps += 1
        assert [slot.request_id for slot in plan.decodes] == ["chat"]
        assert plan.num_tokens <= 512
        assert len([e for e in events_of(events, "chat") if isinstance(e, Token)]) == 1
    assert num_steps == -(-100_000 // 511)  # every chunk is the budget minus one decode, except the last


def test_progress_after_every_prefill_chunk():
    driver = Driver(prefill_chunk=10, max_num_seqs=2)
    driver.add("r", 25, max_tokens=1)
    events = [event for _, event in driver.run_until_idle()]
    progress = [e for e in events if isinstance(e, Progress)]
    assert progress == [Progress(10, 25), Progress(20, 25), Progress(25, 25)]
    assert isinstance(events[-2], Token) and isinstance(events[-1], Done)


def test_tokens_follow_the_script():
    driver = Driver(scripts={"r": [5, 6, 7]}, prefill_chunk=8, max_num_seqs=2)
    driver.add("r", 20, max_tokens=3)
    events = events_of(driver.run_until_idle(), "r")
    assert [e.token_id for e in events if isinstance(e, Token)] == [5, 6, 7]
    assert events[-1] == Done("length", 20, 3)


# ---- admission -----------------------------------------------------------------------------------------


def test_admission_is_fifo_and_bounded_by_max_num_seqs():
    driver = Driver(prefill_chunk=32, max_num_seqs=2)
    for i in range(5):
        driver.add(f"r{i}", 3, max_tokens=2)
    assert (driver.scheduler.num_running, driver.scheduler.num_waiting) == (2, 3)

    first_seen: list[str] = []
    while driver.scheduler.has_work:
        assert driver.scheduler.num_running <= 2
        plan = driver.schedule()
        first_seen += [i for i in plan.request_ids if i not in first_seen]
        driver.finish_step(plan)
    assert first_seen == [f"r{i}" for i in range(5)]


def test_oldest_prefill_goes_first():
    driver = Driver(prefill_chunk=8, max_num_seqs=3)
    driver.add("a", 20, max_tokens=1)
    driver.add("b", 20, max_tokens=1)
    prefill_order = []
    for _ in range(6):
        driver.step()
        prefill_order.append(driver.plans[-1].prefill.request_id)
    assert prefill_order == ["a", "a", "a", "b", "b", "b"]


def test_queue_full():
    driver = Driver(prefill_chunk=16, max_num_seqs=1, max_queued_requests=2)
    driver.add("running")
    driver.add("w1")
    driver.add("w2")
    with pytest.raises(AdmissionError) as refused:
        driver.add("w3")
    assert refused.value.reason == "queue_full" and refused.value.is_overload
    assert "max_queued_requests=2" in refused.value.message
    assert driver.scheduler.num_waiting == 2 and driver.scheduler.get("w3") is None


def test_no_queue_means_run_now_or_refuse():
    driver = Driver(prefill_chunk=16, max_num_seqs=1, max_queued_requests=0)
    driver.add("now")
    with pytest.raises(AdmissionError, match="retry later"):
        driver.add("later")


def test_too_long_prompt_is_refused():
    driver = Driver(prefill_chunk=16, max_num_seqs=1, max_model_len=100)
    with pytest.raises(AdmissionError) as refused:
        driver.add("long", 100)
    assert refused.value.reason == "too_long" and not refused.value.is_overload
    assert "100 tokens" in refused.value.message
    driver.add("fits", 99)


def test_memory_budget_admission_waits_for_room():
    # Each request: (50 prompt + 10 generated) * 10 bytes = 600 of a 1000-byte budget: only one fits at a time.
    driver = Driver(prefill_chunk=64, max_num_seqs=4, memory_budget_bytes=1000)
    driver.add("a", 50, max_tokens=10)
    driver.add("b", 50, max_tokens=10)
    assert (driver.scheduler.num_running, driver.scheduler.num_waiting) == (1, 1)
    assert driver.scheduler.num_reserved_bytes == 600

    while driver.scheduler.get("a") is not None:
        assert "b" not in driver.schedule().request_ids
        driver.finish_step(driver.plans[-1])
    assert "b" in driver.schedule().request_ids
    assert driver.scheduler.num_reserved_bytes == 600


def test_request_that_can_never_fit_is_refused():
    driver = Driver(prefill_chunk=64, max_num_seqs=4, memory_budget_bytes=1000)
    with pytest.raises(AdmissionError) as refused:
        driver.add("huge", 90, max_tokens=20)  # 110 tokens * 10 bytes > 1000
    assert refused.value.reason == "never_fits" and not refused.value.is_overload
    assert "1100 bytes" in refused.value.message


def test_max_model_len_caps_the_memory_reservation():
    driver = Driver(prefill_chunk=64, max_num_seqs=4, memory_budget_bytes=1000, max_model_len=100)
    driver.add("capped", 90, max_tokens=20)  # reserves at 100 tokens, not 110
    assert driver.scheduler.num_reserved_bytes == 1000


def test_config_errors_name_the_value_to_change():
    with pytest.raises(ValueError, match="lower max_num_seqs or raise prefill_chunk"):
        SchedulerConfig(prefill_chunk=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        SchedulerConfig(memory_budget_bytes=0)


# ---- abort -----------------------------------------------------------------------------------------------


def test_abort_frees_a_running_request_within_one_step():
    driver = Driver(prefill_chunk=8, max_num_seqs=1, memory_budget_bytes=10_000)
    driver.add("victim", 40, max_tokens=5)
    driver.add("next", 4, max_tokens=1)
    driver.step()  # victim is mid-prefill
    assert driver.scheduler.num_reserved_bytes == 450

    events = driver.scheduler.abort("victim")
    assert [event for _, event in events] == [Done("abort", 40, 0)]
    assert driver.scheduler.num_running == 0 and driver.scheduler.num_reserved_bytes == 0
    assert driver.schedule().request_ids == ("next",)  # the freed slot is reused on the very next step


def test_abort_frees_a_waiting_request():
    driver = Driver(prefill_chunk=8, max_num_seqs=1)
    driver.add("running", 4, max_tokens=5)
    driver.add("waiting", 4, max_tokens=5)
    assert events_of(driver.scheduler.abort("waiting"), "waiting") == [Done("abort", 4, 0)]
    assert driver.scheduler.num_waiting == 0
    assert driver.scheduler.abort("waiting") == []  # twice: nothing more
    assert driver.scheduler.abort("never-existed") == []


def test_abort_while_the_step_runs_drops_its_result():
    driver = Driver(prefill_chunk=8, max_num_seqs=2)
    driver.add("a", 4, max_tokens=5)
    driver.add("b", 4, max_tokens=5)
    driver.step()  # a prefills
    plan = driver.schedule()  # a decodes, b prefills
    driver.scheduler.abort("a")
    events = driver.finish_step(plan)
    assert events_of(events, "a") == []
    assert [type(e) for e in events_of(events, "b")] == [Progress, Token]


def test_plans_start_each_request_once_and_release_it_once_after_it_ends():
    """The plan is the runner's only news of a request: in `new_requests` on its first scheduled step, in
    `finished_request_ids` on the first plan after it ends, never if it never ran."""
    driver = Driver(prefill_chunk=8, max_num_seqs=2)
    driver.add("a", 10, max_tokens=2)
    driver.add("b", 4, max_tokens=1)
    driver.add("waits", 4, max_tokens=1)  # max_num_seqs=2: queued behind a and b
    first = driver.schedule()
    assert [r.request_id for r in first.new_requests] == ["a"] and first.finished_request_ids == ()
    assert first.new_requests[0].prompt_ids == tuple(range(1, 11))
    driver.finish_step(first)
    driver.scheduler.abort("waits")  # never ran: the runner never hears of it
    plans = [first]
    while driver.scheduler.has_work or driver.scheduler.has_finished_to_release:
        plans.append(driver.schedule())
        driver.finish_step(plans[-1])
    started = [r.request_id for plan in plans for r in plan.new_requests]
    released = [rid for plan in plans for rid in plan.finished_request_ids]
    assert sorted(started) == sorted(released) == ["a", "b"]
    assert plans[-1].num_tokens == 0 and plans[-1].finished_request_ids  # the last plan only releases
    assert not driver.runner.live_ids


# ---- finishing -------------------------------------------------------------------------------------------


def test_stop_token_ends_with_stop_and_is_counted_not_streamed():
    driver = Driver(scripts={"r": [5, 6, 99, 7]}, prefill_chunk=8, max_num_seqs=1)
    driver.add("r", 4, max_tokens=10, stop_token_ids=(99,))
    events = events_of(driver.run_until_idle(), "r")
    assert [e.token_id for e in events if isinstance(e, Token)] == [5, 6]
    assert events[-1] == Done("stop", 4, 3)


def test_eos_stops_unless_ignore_eos():
    scripts = {"eos": [5, 2, 7], "ignore": [5, 2, 7]}
    driver = Driver(eos_token_ids=(2,), scripts=scripts, prefill_chunk=8, max_num_seqs=2)
    driver.add("eos", 4, max_tokens=3)
    driver.add("ignore", 4, max_tokens=3, ignore_eos=True)
    events = driver.run_until_idle()
    assert events_of(events, "eos")[-1] == Done("stop", 4, 2)
    assert [e.token_id for e in events_of(events, "ignore") if isinstance(e, Token)] == [5, 2, 7]
    assert events_of(events, "ignore")[-1] == Done("length", 4, 3)


def test_max_model_len_ends_with_length():
    driver = Driver(prefill_chunk=8, max_num_seqs=1, max_model_len=10)
    driver.add("r", 7, max_tokens=100)
    events = events_of(driver.run_until_idle(), "r")
    assert events[-1] == Done("length", 7, 3)  # 7 + 3 = max_model_len


def test_finished_request_carries_its_timings():
    driver = Driver(prefill_chunk=8, max_num_seqs=1)
    request = driver.add("r", 4, max_tokens=2)
    done = driver.run_until_idle()[-1][1]
    assert request.is_finished and request.finish_reason == "length"
    assert request.output_ids == driver.runner.expected_tokens("r", request.prompt_ids, 2)
    timings = done.timings
    assert min(timings.queue_seconds, timings.prefill_seconds, timings.decode_seconds) >= 0
    assert timings.e2e_seconds == pytest.approx(
        timings.queue_seconds + timings.prefill_seconds + timings.decode_seconds
    )


def test_request_aborted_while_waiting_has_no_prefill_or_decode_time():
    driver = Driver(prefill_chunk=8, max_num_seqs=1)
    driver.add("running")
    driver.add("waiting")
    done = driver.scheduler.abort("waiting")[0][1]
    assert done.timings.queue_seconds is None and done.timings.prefill_seconds is None
    assert done.timings.e2e_seconds >= 0


def test_fail_ends_requests_with_an_internal_error():
    driver = Driver(prefill_chunk=8, max_num_seqs=2)
    driver.add("a")
    driver.add("b")
    events = driver.scheduler.fail(["a"], "boom")
    assert events_of(events, "a") == [Error("boom", kind="internal")]
    assert driver.scheduler.request_ids == ("b",)
