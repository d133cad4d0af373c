"""The engine thread's queue: tenant fairness, bounded admission, cancellation, failures, shutdown.

A scripted engine stands in for the model, so these tests check scheduling alone.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.engine.request import FinishEvent, GenerationRequest, PrefillReport, RequestHandle, TokenEvent
from kvtier.engine.runner import Sequence, StepResult
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.scheduler import QueueFull, Scheduler


class ScriptedEngine:
    """Emits token ``i`` at step ``i``; a prompt of [999] fails its admission."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.prefills: list[str] = []
        self.gate = gate

    def admit(self, handle: RequestHandle) -> Sequence:
        if self.gate is not None:
            self.gate.wait(10)
        if handle.request.prompt_ids == (999,):
            raise RuntimeError("bad prompt")
        self.prefills.append(handle.request.tenant)
        return Sequence(handle, None, Sampler(SamplingParams()), list(handle.request.prompt_ids),
                        PrefillReport(len(handle.request.prompt_ids)))

    def step(self, running: list[Sequence]) -> StepResult:
        for seq in running:
            self._emit(seq)
        return StepResult()

    def _emit(self, seq: Sequence) -> None:
        seq.tokens.append(seq.generated)
        seq.generated += 1
        seq.handle._emit(TokenEvent(seq.generated - 1))

    def finished_reason(self, seq: Sequence) -> str | None:
        if seq.handle.cancelled:
            return "cancelled"
        return "length" if seq.generated >= seq.request.max_new_tokens else None

    def finish(self, seq: Sequence, reason: str, error: Exception | None = None) -> None:
        seq.handle._emit(FinishEvent(reason, seq.generated, seq.report,
                                     None if error is None else str(error)))


def _request(tenant: str = "", tokens: int = 3, prompt: tuple[int, ...] = (1, 2)) -> RequestHandle:
    return RequestHandle(GenerationRequest(prompt, tokens, tenant=tenant))


@pytest.fixture
def gate():
    return threading.Event()


def test_tenants_are_admitted_round_robin_not_first_come(gate):
    engine = ScriptedEngine(gate)
    sched = Scheduler(engine, max_running=1, max_pending=32)
    sched.start()
    try:
        first = sched.submit(_request("a", tokens=1))   # occupies the engine behind the gate
        time.sleep(0.1)
        handles = [sched.submit(_request("a", tokens=1)) for _ in range(4)]
        handles += [sched.submit(_request("b", tokens=1)) for _ in range(2)]
        gate.set()
        for h in [first, *handles]:
            assert h.done.wait(10)
    finally:
        sched.stop()
    assert engine.prefills == ["a", "a", "b", "a", "b", "a", "a"]


def test_every_request_gets_all_its_tokens_and_one_finish():
    sched = Scheduler(ScriptedEngine(), max_running=3, max_pending=64)
    sched.start()
    try:
        handles = [sched.submit(_request(str(i % 3), tokens=5 + i % 4)) for i in range(20)]
        results = [h.result(timeout=10) for h in handles]
    finally:
        sched.stop()
    for i, (tokens, finish) in enumerate(results):
        assert tokens == list(range(5 + i % 4))
        assert finish.reason == "length" and finish.completion_tokens == len(tokens)
    assert sched.stats()["finished"] == 20 and sched.stats()["queued"] == 0


def test_a_full_queue_refuses_with_queue_full(gate):
    sched = Scheduler(ScriptedEngine(gate), max_running=1, max_pending=2)
    sched.start()
    try:
        accepted = [sched.submit(_request()), sched.submit(_request())]
        with pytest.raises(QueueFull, match="limit is 2"):
            sched.submit(_request())
        assert sched.stats()["rejected"] == 1
        gate.set()
        for h in accepted:
            assert h.done.wait(10)
        sched.submit(_request()).result(timeout=10)  # room again once they finish
    finally:
        gate.set()
        sched.stop()


def test_a_failing_request_gets_an_error_and_the_engine_keeps_serving():
    sched = Scheduler(ScriptedEngine(), max_running=2, max_pending=8)
    sched.start()
    try:
        bad = sched.submit(_request(prompt=(999,)))
        good = sched.submit(_request(tokens=2))
        _, finish = bad.result(timeout=10)
        assert finish.reason == "error" and "bad prompt" in finish.error
        assert good.result(timeout=10)[1].reason == "length"
    finally:
        sched.stop()
    assert sched.stats()["failed"] == 1


def test_cancelled_request_stops_generating():
    sched = Scheduler(ScriptedEngine(), max_running=1, max_pending=8)
    handle = _request(tokens=10_000)
    seen = []

    def sink(event):
        seen.append(event)
        if len(seen) == 3:
            handle.cancel()

    handle.set_sink(sink)
    sched.start()
    try:
        sched.submit(handle)
        assert handle.done.wait(10)
    finally:
        sched.stop()
    assert isinstance(seen[-1], FinishEvent) and seen[-1].reason == "cancelled"
    assert seen[-1].completion_tokens < 10


def test_shutdown_finishes_queued_and_running_requests(gate):
    sched = Scheduler(ScriptedEngine(gate), max_running=1, max_pending=8)
    sched.start()
    handles = [sched.submit(_request(tokens=10_000)) for _ in range(3)]
    time.sleep(0.05)
    gate.set()
    time.sleep(0.05)
    sched.stop()
    for handle in handles:
        assert handle.done.is_set()
    with pytest.raises(QueueFull):
        sched.submit(_request())


class PreemptingEngine(ScriptedEngine):
    """Preempts the newest running sequence at step 2 (once); it must come back first."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.admitted: list[str] = []

    def admit(self, item):
        if isinstance(item, Sequence):
            self.admitted.append(f"resumed {item.request.request_id}")
            return item
        seq = super().admit(item)
        self.admitted.append(item.request.request_id)
        return seq

    def step(self, running: list[Sequence]) -> StepResult:
        self.steps += 1
        if self.steps == 2:
            return StepResult(preempted=[running[-1]])
        return super().step(running)


def test_a_preempted_sequence_is_admitted_again_before_new_requests():
    engine = PreemptingEngine()
    sched = Scheduler(engine, max_running=2, max_pending=8)
    handles = [RequestHandle(GenerationRequest((1,), 4, request_id=f"r{i}")) for i in range(3)]
    for handle in handles:
        sched.submit(handle)
    sched.start()
    try:
        results = [h.result(timeout=10) for h in handles]
    finally:
        sched.stop()
    assert engine.admitted[:4] == ["r0", "r1", "resumed r1", "r2"]
    assert [tokens for tokens, _ in results] == [[0, 1, 2, 3]] * 3
    assert sched.stats()["finished"] == 3
