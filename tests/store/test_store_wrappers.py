"""Wrapper stores: each passes the store contract, and latency, faults and counts behave as set."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import StoreUnavailable
from kvtier.store.base import PageStore
from kvtier.store.memory import MemoryStore
from kvtier.store.wrappers import CountingStore, FaultRule, FaultStore, LatencyStore, WrapperStore
from store_contract import StoreContract, key_for

PAGE = 512


class TestLatencyStoreContract(StoreContract):
    machine_examples = 10

    def make_store(self, tmp_path: Path, page_bytes: int) -> PageStore:
        return LatencyStore(MemoryStore(page_bytes), read_s=0.0001, jitter=0.5)


class TestFaultStoreWithoutRulesContract(StoreContract):
    machine_examples = 10

    def make_store(self, tmp_path: Path, page_bytes: int) -> PageStore:
        return FaultStore(MemoryStore(page_bytes), [FaultRule("read", "error", probability=0.0)])


class TestCountingStoreContract(StoreContract):
    machine_examples = 10

    def make_store(self, tmp_path: Path, page_bytes: int) -> PageStore:
        return CountingStore(MemoryStore(page_bytes))


def _filled(indexes: range = range(4)) -> MemoryStore:
    store = MemoryStore(PAGE)
    store.write([key_for(i) for i in indexes], [bytes([i]) * PAGE for i in indexes])
    return store


def _read(store: PageStore, indexes: list[int]) -> tuple[list[bool], list[np.ndarray]]:
    buffers = [np.zeros(PAGE, np.uint8) for _ in indexes]
    return store.read_into([key_for(i) for i in indexes], buffers), buffers


def test_latency_store_sleeps_per_call_and_per_page():
    store = LatencyStore(_filled(), read_s=0.02, per_page_s=0.01)
    start = time.perf_counter()
    found, _ = _read(store, [0, 1, 2])
    assert found == [True] * 3
    assert time.perf_counter() - start >= 0.05


def test_read_error_fails_only_the_named_pages_and_counts_them():
    store = FaultStore(_filled(), [FaultRule("read", "error", keys=frozenset({key_for(1)}))])
    found, buffers = _read(store, [0, 1, 2])
    assert found == [True, False, True] and not buffers[1].any()
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.errors, stats.corrupt) == (2, 1, 1, 0)


def test_corrupt_read_is_a_miss_counted_as_corrupt():
    store = FaultStore(_filled(), [FaultRule("read", "corrupt", limit=1)])
    assert _read(store, [0, 0])[0] == [False, True]
    stats = store.stats()
    assert (stats.misses, stats.corrupt) == (1, 1)


def test_garbled_read_succeeds_with_different_bytes():
    store = FaultStore(_filled(), [FaultRule("read", "garble")])
    found, buffers = _read(store, [3])
    assert found == [True] and buffers[0].tobytes() != bytes([3]) * PAGE


def test_refused_write_is_not_stored_and_is_counted():
    store = FaultStore(MemoryStore(PAGE), [FaultRule("write", "refuse", skip=1, limit=1)])
    keys = [key_for(i) for i in range(3)]
    assert store.write(keys, [bytes(PAGE)] * 3) == [True, False, True]
    assert store.contains(keys) == [True, False, True]
    assert store.stats().refused == 1 and store.stats().errors == 0


def test_write_error_counts_refusal_and_error():
    store = FaultStore(MemoryStore(PAGE), [FaultRule("write", "error")])
    assert store.write([key_for(0)], [bytes(PAGE)]) == [False]
    assert (store.stats().refused, store.stats().errors) == (1, 1)


def test_raise_fault_escapes_as_store_unavailable_and_respects_limit():
    store = FaultStore(_filled(), [FaultRule("contains", "raise", limit=1)])
    with pytest.raises(StoreUnavailable):
        store.contains([key_for(0)])
    assert store.contains([key_for(0)]) == [True]
    assert store.fired() == {("contains", "raise"): 1}


def test_hang_blocks_until_released_then_fails_as_error():
    store = FaultStore(_filled(), [FaultRule("read", "hang", hang_s=30)])
    result: list[list[bool]] = []
    th = threading.Thread(target=lambda: result.append(_read(store, [0])[0]))
    th.start()
    deadline = time.monotonic() + 5
    while store.hanging() == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert store.hanging() == 1 and not result
    store.release_hangs()
    th.join(5)
    assert result == [[False]] and store.stats().errors == 1


def test_hang_ends_at_its_deadline():
    store = FaultStore(_filled(), [FaultRule("write", "hang", hang_s=0.05)])
    start = time.perf_counter()
    assert store.write([key_for(9)], [bytes(PAGE)]) == [False]
    assert time.perf_counter() - start >= 0.05 and store.contains([key_for(9)]) == [False]


def test_seeded_probability_is_reproducible():
    def pattern(seed: int) -> list[bool]:
        store = FaultStore(_filled(range(20)), [FaultRule("read", "error", probability=0.5)],
                           seed=seed)
        return _read(store, list(range(20)))[0]

    assert pattern(7) == pattern(7)
    assert 0 < sum(pattern(7)) < 20


def test_clear_drops_rules_and_faulted_delete_keeps_the_page():
    store = FaultStore(_filled(), [FaultRule("delete", "error")])
    assert store.delete([key_for(0)]) == 0 and store.contains([key_for(0)]) == [True]
    store.clear()
    assert store.delete([key_for(0)]) == 1


def test_rules_reject_impossible_faults():
    with pytest.raises(ValueError):
        FaultRule("write", "corrupt")
    with pytest.raises(ValueError):
        FaultRule("read", "refuse")
    with pytest.raises(ValueError):
        FaultRule("read", "hang", hang_s=0)
    with pytest.raises(ValueError):
        FaultRule("scan", "error")


def test_faulted_range_read_is_a_miss():
    from kvtier.layout import ByteRange

    store = FaultStore(_filled(), [FaultRule("read", "corrupt", keys=frozenset({key_for(2)}))])
    out = [np.zeros(8, np.uint8), np.zeros(8, np.uint8)]
    assert store.read_ranges_into([key_for(1), key_for(2)], [ByteRange(4, 8)], out) == [True, False]
    assert out[0].tolist() == [1] * 8


def test_counting_store_counts_calls_pages_hits_and_peak_concurrency():
    store = CountingStore(LatencyStore(_filled(), read_s=0.05), record=True)
    threads = [threading.Thread(target=_read, args=(store, [0, 7])) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    store.write([key_for(8)], [bytes(PAGE)])
    read = store.counts()["read"]
    assert (read.calls, read.pages, read.ok) == (3, 6, 3)
    assert read.peak_in_flight >= 2 and read.seconds >= 0.15
    assert store.counts()["write"].ok == 1
    assert store.log[-1] == ("write", (key_for(8),))


def test_wrappers_nest_and_close_the_inner_store():
    inner = _filled()
    store = CountingStore(FaultStore(LatencyStore(inner)))
    assert isinstance(store, WrapperStore) and store.scheme == "memory"
    store.close()
    assert inner._closed
