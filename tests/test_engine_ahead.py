"""Decode steps queued one step ahead (``engine.ahead``), their bookkeeping on the CPU: the
static decode steps run eagerly in place of the graphs, so every rule of the look-ahead runs
here, only without the overlap. The tokens must be those of steps run one at a time, whatever
ends, waits, is preempted or samples; rows are taken only where they match; and no sequence's
pages go back while a step ahead may still write them."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.engine import ahead as ahead_module
from kvtier.engine import paged
from kvtier.engine.ahead import Ahead, AheadRow, Chosen, Lookahead
from kvtier.engine.decode_graphs import DecodeGraphs
from kvtier.engine.request import GenerationRequest
from kvtier.engine.sampling import SamplingParams
from test_engine_batching import PROMPTS, _greedy, _prompt, _service
from test_engine_support import tiny_lm


def _with_graphs(service, ahead: bool):
    """The service's engine serving decodes from (eager) static graphs, with or without the
    look-ahead: the same forwards either way, so only the look-ahead differs."""
    graphs = DecodeGraphs(service.lm, 8, service.engine.pages.scratch_page, capture=False,
                          backend="torch")
    service.engine.decode_graphs = graphs
    service.engine.lookahead = Lookahead(graphs) if ahead else None
    return service


def _requests() -> list[GenerationRequest]:
    """Greedy requests of several lengths, one stopping at a token it generates."""
    stop = _greedy(tiny_lm(), PROMPTS[0], 9)[5]
    reqs = [GenerationRequest(tuple(p), new) for p, new in zip(PROMPTS, (9, 3, 12, 1, 7, 10),
                                                                 strict=True)]
    reqs[0] = GenerationRequest(tuple(PROMPTS[0]), 9, stop_token_ids=(stop,))
    return reqs


def _serve(service, requests: list[GenerationRequest]) -> list[tuple[list[int], str]]:
    """Every request submitted while the engine thread waits, so the steps (and how many of
    them run ahead) do not depend on how the threads interleave."""
    gate = threading.Event()
    held = service.scheduler.call_soon(lambda: gate.wait(60))
    handles = [service.submit(r) for r in requests]
    gate.set()
    held.result(timeout=60)
    return [(tokens, finish.reason) for tokens, finish in (h.result(timeout=300)
                                                           for h in handles)]


def _both(requests_of, max_running: int, **flags) -> tuple[list, list, dict]:
    """What one service gives one step at a time and another with the look-ahead."""
    got = []
    for ahead in (False, True):
        service = _with_graphs(_service(max_running, **flags), ahead)
        try:
            got.append(_serve(service, requests_of()))
            stats = service.engine.stats()
            if service.prefix_cache is not None:
                service.prefix_cache.tiered.check_integrity()
        finally:
            service.close()
    return got[0], got[1], stats


@pytest.mark.parametrize("cache", ["true", "false"])
def test_steps_queued_ahead_give_the_tokens_of_steps_run_one_at_a_time(cache):
    want, got, stats = _both(_requests, 6, **{"engine.prefill_chunk_tokens": 1000,
                                             "cache.enabled": cache})
    assert got == want
    assert [reason for _, reason in got] == ["stop", "length", "length", "length", "length",
                                             "length"]
    assert stats["ahead_steps"] >= 5 and stats["ahead_rows_taken"] >= 20


@pytest.mark.parametrize("cache", ["true", "false"])
def test_admissions_and_preemptions_while_a_step_is_ahead_keep_every_token(cache):
    """Three run at a time out of four (an end admits the fourth while a step is ahead), in a
    pool too small for three."""
    prompts = [_prompt(40, 50 + i) for i in range(4)]
    want = [_greedy(tiny_lm(), p, 30) for p in prompts]
    _, got, stats = _both(lambda: [GenerationRequest(tuple(p), 30) for p in prompts], 3,
                          **{"cache.device_pages": 12, "cache.enabled": cache})
    assert [tokens for tokens, _ in got] == want
    assert stats["preempted"] > 0 and stats["ahead_rows_taken"] > 0


def test_sampled_requests_step_one_at_a_time_and_keep_their_seeded_tokens():
    def requests():
        sampled = [GenerationRequest(tuple(PROMPTS[i]), 8,
                                     SamplingParams(temperature=0.8, top_p=0.9, seed=i))
                   for i in (1, 3)]
        return [GenerationRequest(tuple(PROMPTS[0]), 20), *sampled,
                GenerationRequest(tuple(PROMPTS[2]), 20)]
    want, got, stats = _both(requests, 4, **{"engine.prefill_chunk_tokens": 1000})
    assert got == want
    assert stats["ahead_rows_taken"] > 0      # once the sampled ones ended


class _Event:
    """A CUDA event's stand-in: ``synchronize`` marks it passed."""

    def __init__(self) -> None:
        self.passed = False

    def synchronize(self) -> None:
        self.passed = True


def test_pages_go_back_only_once_the_step_ahead_completed(monkeypatch):
    plain = Chosen.of

    def with_event(logits: torch.Tensor) -> Chosen:
        chosen = plain(logits)
        chosen.event = _Event()
        return chosen
    monkeypatch.setattr(ahead_module.Chosen, "of", staticmethod(with_event))
    service = _with_graphs(_service(6, **{"engine.prefill_chunk_tokens": 1000}), True)
    engine, closes = service.engine, []
    close = engine.pages.close

    def checked_close(pages, tokens, *, commit):
        pending = engine.lookahead.pending
        closes.append(pending is None or pending.chosen.event.passed)
        close(pages, tokens, commit=commit)
    engine.pages.close = checked_close
    try:
        _serve(service, _requests())
        ahead = engine.stats()["ahead_steps"]
    finally:
        service.close()
    assert ahead > 0 and len(closes) == 6 and all(closes)


def _pending(rows: list[tuple[str, int, tuple[int, ...]]], fed: list[int]) -> Ahead:
    tokens = torch.tensor(fed)
    return Ahead([AheadRow(seq, start, pages) for seq, start, pages in rows],
                 Chosen(torch.tensor([7, 8, 9]), torch.tensor([7, 8, 9])),
                 Chosen(tokens, tokens), [2, 1, 0])


def test_only_rows_at_the_same_position_token_and_pages_are_taken():
    lookahead = Lookahead(None)
    lookahead.pending = _pending([("a", 10, (1, 2)), ("b", 7, (3,)), ("c", 4, (5,))],
                                 fed=[30, 20, 10])
    planned = [("c", paged.BatchRow([5], 4, [30])),         # fed 30 (fed_index 0 -> 30)
               ("x", paged.BatchRow([9], 3, [1])),          # not in the step ahead
               ("b", paged.BatchRow([3], 7, [21])),         # another token
               ("a", paged.BatchRow([1, 2], 10, [10]))]     # fed 10: taken
    taken, pending = lookahead.take(planned)
    assert taken == {0: 2, 3: 0} and pending is not None
    assert lookahead.pending is None
    assert lookahead.counters == {"ahead_steps": 0, "ahead_rows_taken": 2,
                                  "ahead_rows_dropped": 1}
    lookahead.pending = _pending([("a", 10, (1, 2))], fed=[0, 0, 0])
    moved = [("a", paged.BatchRow([1, 4], 10, [0]))]       # its pages changed
    later = [("a", paged.BatchRow([1, 2], 11, [0]))]       # another position
    assert lookahead.take(moved) == ({}, None)
    lookahead.pending = _pending([("a", 10, (1, 2))], fed=[0, 0, 0])
    assert lookahead.take(later) == ({}, None)
