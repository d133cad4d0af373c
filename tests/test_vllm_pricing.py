"""Whether a hit's store part is worth waiting for inside vLLM (``integrations.vllm.pricing``):
vLLM's prefill rate learnt from busy steps only, and the store part priced against it from
measured rates only. Pure Python: runs without vLLM."""

from __future__ import annotations

import pytest

from kvtier.controller.rates import RateBook
from kvtier.integrations.vllm.pricing import (
    DECLINE_FACTOR,
    MIN_TIMED_TOKENS,
    StepClock,
    store_part_pays,
)

TOKEN_BYTES = 131072            # llama3-8b's KV: 128 KiB a token


def _rate(steps: list[tuple[float, int, set[str]]]) -> float | None:
    clock = StepClock()
    for now, tokens, ran in steps:
        clock.step(now, tokens, ran)
    return clock.tokens_per_s


def test_a_run_of_busy_steps_is_timed_from_its_second_step():
    # the first interval of a run is not a step's time (asynchronous scheduling queues the
    # first two steps back to back): 1000 tokens in 0.5 s from the second step on
    assert _rate([(0.0, 1000, {"a"}), (0.001, 1000, {"a"}), (0.501, 1000, {"a"}),
                  (1.001, 16, {"a"})]) == pytest.approx(2000.0)


def test_idle_gaps_and_small_steps_are_not_timed():
    assert _rate([(0.0, 1000, {"a"}), (0.1, 1000, {"b"}),   # "b" is new: the engine may
                  (0.2, 100, {"b"}), (0.3, 1000, {"b"}),    # have idled; then a small step
                  (9.0, 1000, {"c"}), (9.5, 0, set())]) is None
    small = MIN_TIMED_TOKENS - 1
    assert _rate([(0.0, small, {"a"}), (1.0, small, {"a"}), (2.0, small, {"a"}),
                  (3.0, 1, {"a"})]) is None


def _book(disk_rate: float, read: bool, fixed: float = 0.0) -> RateBook:
    book = RateBook.for_device("cuda")
    book.rates["disk"] = (disk_rate, fixed)
    if read:
        book.observed["disk"] = 1
    return book


def test_a_store_part_is_declined_only_on_measured_rates_that_say_it_is_slower():
    part = {"host": 4096, "disk": 28672}
    # 1.6 GB/s: ~12k tokens/s against vLLM's 28k/s: more than DECLINE_FACTOR times slower
    assert store_part_pays(part, _book(1.6e9, True), 28000.0, TOKEN_BYTES) is False
    # the page cache, 12 GB/s: ~92k tokens/s
    assert store_part_pays(part, _book(12e9, True), 28000.0, TOKEN_BYTES) is True
    # slower than the prefill, but within the factor: read, as before pricing
    within = 28000.0 * TOKEN_BYTES / (DECLINE_FACTOR * 0.9)
    assert store_part_pays(part, _book(within, True), 28000.0, TOKEN_BYTES) is True
    # no read seen yet, or no prefill rate learnt: unknown, the part is claimed as before
    assert store_part_pays(part, _book(1.6e9, False), 28000.0, TOKEN_BYTES) is None
    assert store_part_pays(part, _book(1.6e9, True), None, TOKEN_BYTES) is None
    # no store part at all
    assert store_part_pays({"host": 4096}, _book(1.6e9, True), 28000.0, TOKEN_BYTES) is None


def test_a_stores_fixed_cost_counts_against_it():
    assert store_part_pays({"disk": 1024}, _book(100e9, True, fixed=0.5), 28000.0,
                           TOKEN_BYTES) is False


def test_reads_are_counted_as_observations():
    book = RateBook.for_device("cuda")
    book.observe("disk", 1 << 20, 0.001)
    book.observe_load("remote", 1 << 20, 0.002)
    assert book.observed == {"disk": 1, "remote": 1}
