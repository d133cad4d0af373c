"""Whether a hit's store part is worth waiting for inside vLLM (``integrations.vllm.pricing``):
vLLM's prefill rate learnt from busy steps only, and the store part priced against it from
measured rates only. Pure Python: runs without vLLM."""

from __future__ import annotations

from kvtier.controller.rates import RateBook
from kvtier.integrations.vllm.pricing import MIN_TIMED_TOKENS, StepClock, store_part_pays

TOKEN_BYTES = 131072            # llama3-8b's KV: 128 KiB a token


def _clock_run(steps: list[tuple[float, int, set[str]]]) -> list[tuple[int, float]]:
    seen: list[tuple[int, float]] = []
    clock = StepClock()
    for now, tokens, ran in steps:
        clock.step(now, tokens, ran, lambda n, s: seen.append((n, round(s, 6))))
    return seen


def test_a_step_is_timed_only_when_the_engine_stayed_busy_and_it_ran_enough_tokens():
    seen = _clock_run([
        (0.0, 2048, {"a"}),          # timed by the next step: "a" runs on
        (0.1, 2048, {"a", "b"}),     # timed: "b" runs on
        (0.3, 16, {"b"}),            # a decode step: too few tokens to time
        (0.31, 0, set()),            # nothing scheduled
        (5.0, 4096, {"c"}),          # after an idle gap: the gap is not timed
        (5.2, 4096, {"d"}),          # "c" does not run on: the engine may have idled
        (9.0, 1, {"d"}),
    ])
    assert seen == [(2048, 0.1), (2048, 0.2), (4096, 3.8)]


def test_min_tokens_bound():
    assert _clock_run([(0.0, MIN_TIMED_TOKENS - 1, {"a"}), (1.0, 300, {"a"})]) == []


def _book(prefill: float | None, disk_rate: float, read: bool) -> RateBook:
    book = RateBook.for_device("cuda")
    book.prefill_tokens_per_s = prefill
    book.rates["disk"] = (disk_rate, 0.0)
    if read:
        book.observed["disk"] = 1
    return book


def test_a_store_part_is_declined_only_on_measured_rates_that_say_it_is_slower():
    part = {"host": 4096, "disk": 28672}
    # 1.6 GB/s: ~12k tokens/s against a prefill of 28k/s -> slower
    assert store_part_pays(part, _book(28000.0, 1.6e9, True), TOKEN_BYTES) is False
    # the page cache: 12 GB/s -> ~92k tokens/s, faster than the prefill
    assert store_part_pays(part, _book(28000.0, 12e9, True), TOKEN_BYTES) is True
    # no read seen yet, or no prefill rate learnt: unknown, the part is claimed as before
    assert store_part_pays(part, _book(28000.0, 1.6e9, False), TOKEN_BYTES) is None
    assert store_part_pays(part, _book(None, 1.6e9, True), TOKEN_BYTES) is None
    # no store part at all
    assert store_part_pays({"host": 4096}, _book(28000.0, 1.6e9, True), TOKEN_BYTES) is None


def test_a_stores_fixed_cost_counts_against_it():
    book = _book(28000.0, 100e9, True)
    book.rates["disk"] = (100e9, 0.5)            # half a second before the first byte
    assert store_part_pays({"disk": 1024}, book, TOKEN_BYTES) is False


def test_reads_are_counted_as_observations():
    book = RateBook.for_device("cuda")
    book.observe("disk", 1 << 20, 0.001)
    book.observe_load("remote", 1 << 20, 0.002)
    assert book.observed == {"disk": 1, "remote": 1}
