"""A request is in the scheduler's counters and latency histograms before its submitter hears
that it ended, so a client that reads ``/metrics`` right after its response sees it: for a
request that ran and for one cancelled while it waited. Engine thread of a real
``EngineService`` on the tiny model."""

from __future__ import annotations

from typing import Any

from kvtier.engine.request import FinishEvent, GenerationRequest, RequestHandle
from kvtier.engine.service import EngineService
from test_engine_support import make_config, tiny_lm


def _counted(service: EngineService) -> tuple[int, int]:
    """Requests that ended (finished or cancelled) and end-to-end latencies observed."""
    counters = service.scheduler.counters
    e2e = service.scheduler.requests.snapshot()["e2e_seconds"]["count"]
    return counters["finished"] + counters["cancelled"], e2e


def test_a_request_is_counted_before_its_end_is_told(monkeypatch):
    service = EngineService.build(make_config(cache__enabled="false"), lm=tiny_lm(),
                                  max_running=1)
    told: list[tuple[str, tuple[int, int]]] = []
    emit = RequestHandle._emit

    def watching(self: RequestHandle, event: Any) -> None:
        if isinstance(event, FinishEvent):
            told.append((event.reason, _counted(service)))
        emit(self, event)

    monkeypatch.setattr(RequestHandle, "_emit", watching)
    try:
        service.generate(GenerationRequest(tuple(range(5, 20)), max_new_tokens=3), timeout=60)
        running = service.submit(GenerationRequest(tuple(range(5, 40)), max_new_tokens=5000,
                                                   stop_token_ids=()))
        waiting = service.submit(GenerationRequest(tuple(range(6, 40)), max_new_tokens=3))
        waiting.cancel()
        running.cancel()
        for handle in (waiting, running):
            assert handle.done.wait(60)
    finally:
        service.close()
    assert told[0] == ("length", (1, 1))
    assert [reason for reason, _ in told[1:]] == ["cancelled", "cancelled"]
    assert [counts for _, counts in told[1:]] == [(2, 2), (3, 3)]
