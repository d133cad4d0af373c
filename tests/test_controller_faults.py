"""A failing store is a counted miss: it never corrupts the cache, never hangs it, never turns a
tier off for good."""

from __future__ import annotations

import time
import uuid

from cache_support import LAYOUT, P, assert_kv, make_cache, prompt, serve, store_keys
from kvtier.store.memory import MemoryStore
from kvtier.store.wrappers import FaultRule, FaultStore


def named_store() -> tuple[str, MemoryStore]:
    name = f"faults-{uuid.uuid4().hex}"
    return name, MemoryStore(LAYOUT.page_bytes, name=name)


def seeded(tokens: list[int]) -> str:
    name, store = named_store()
    with make_cache(stores={"disk": store}) as writer:
        serve(writer, tokens)
        assert writer.drain()
    return name


def handle(name: str) -> MemoryStore:
    return MemoryStore(LAYOUT.page_bytes, name=name)


def test_read_error_mid_prefix_serves_the_pages_before_it_and_recovers() -> None:
    tokens = prompt(8, seed=1)
    bad = store_keys(tokens)[5]
    faulty = FaultStore(handle(seeded(tokens)), [FaultRule("read", "error", keys=frozenset({bad}))])
    with make_cache(stores={"disk": faulty}, prefetch_policy="wait_complete") as cache:
        loaded = cache.load(cache.match(tokens))
        assert loaded.tokens == 5 * P
        assert_kv(cache, tokens, loaded.device_page_ids)
        cache.release(loaded)
        assert cache.stats()["counters"]["prefetch_total"] == {"failed": 1}
        cache.check_integrity()
        faulty.clear()  # the store heals: the same tier serves again, nothing was switched off
        _, again = serve(cache, tokens)
        assert again.tokens == 8 * P
        cache.check_integrity()


def test_corrupt_page_is_a_counted_miss() -> None:
    tokens = prompt(6, seed=2)
    bad = store_keys(tokens)[0]
    faulty = FaultStore(handle(seeded(tokens)),
                        [FaultRule("read", "corrupt", keys=frozenset({bad}))])
    with make_cache(stores={"disk": faulty}, prefetch_policy="wait_complete") as cache:
        _, loaded = serve(cache, tokens)
        assert loaded.tokens == 0
        assert faulty.stats().corrupt == 1
        assert cache.match(tokens).tokens_by_tier["device"] == 6 * P  # recomputed and kept
        cache.check_integrity()


def test_store_flag_of_a_page_the_store_lost_is_dropped() -> None:
    name, store = named_store()
    tokens = prompt(6, seed=3)
    with make_cache(stores={"disk": store}, prefetch_policy="wait_complete") as cache:
        serve(cache, tokens)
        cache.drain()
        cache.flush()
        assert cache.match(tokens).tokens_by_tier["disk"] == 6 * P
        handle(name).delete([store_keys(tokens)[3]])  # evicted behind the index's back
        loaded = cache.load(cache.match(tokens))
        assert loaded.tokens == 3 * P
        cache.release(loaded)
        cache.drain()
        hit = cache.match(tokens)
        assert hit.reach("disk") == 3  # the index no longer claims pages 3.. are on disk
        assert cache.stats()["counters"]["store_flag_dropped_total"] == {"disk": 1}
        cache.check_integrity()


def test_store_that_raises_is_a_miss_and_the_worker_survives() -> None:
    tokens = prompt(6, seed=4)
    faulty = FaultStore(handle(seeded(tokens)), [FaultRule("read", "raise", limit=1)])
    with make_cache(stores={"disk": faulty}, prefetch_policy="wait_complete", io_workers=1) as cache:
        loaded = cache.load(cache.match(tokens))
        assert loaded.tokens == 0
        cache.release(loaded)
        cache.drain()
        assert cache.stats()["counters"]["prefetch_errors_total"] == 1
        loaded = cache.load(cache.match(tokens))  # same single worker, still alive
        assert loaded.tokens == 6 * P
        cache.release(loaded)
        cache.check_integrity()


def test_probe_that_raises_reports_no_store_hit() -> None:
    tokens = prompt(4, seed=5)
    faulty = FaultStore(handle(seeded(tokens)), [FaultRule("contains", "raise")])
    with make_cache(stores={"disk": faulty}) as cache:
        hit = cache.match(tokens)
        assert hit.tokens == 0
        assert cache.stats()["counters"]["store_probe_errors_total"] == {"disk": 1}


def test_refused_write_keeps_the_stored_prefix_contiguous() -> None:
    name, store = named_store()
    tokens = prompt(8, seed=6)
    keys = store_keys(tokens)
    faulty = FaultStore(store, [FaultRule("write", "refuse", keys=frozenset({keys[3]}))])
    with make_cache(stores={"disk": faulty}) as cache:
        serve(cache, tokens)
        assert cache.drain()
        assert handle(name).contains(keys) == [True] * 3 + [False] * 5
        assert cache.stats()["tiers"]["disk"]["pages"] == 3
        counters = cache.stats()["counters"]
        assert counters["backup_total"]["disk"] == {"failed": 1}
        assert cache.stats()["write_admission"]["used_pages"] == 0
        cache.check_integrity()


def test_hanging_write_neither_blocks_requests_nor_close() -> None:
    _name, store = named_store()
    faulty = FaultStore(store, [FaultRule("write", "hang", hang_s=30)])
    cache = make_cache(stores={"disk": faulty}, io_workers=1)
    started = time.monotonic()
    for seed in range(3):
        serve(cache, prompt(4, seed=10 + seed))
    assert time.monotonic() - started < 2.0
    deadline = time.monotonic() + 5.0      # the one IO worker picks the first write up
    while faulty.hanging() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert faulty.hanging() == 1
    cache.check_integrity()
    faulty.release_hangs()
    cache.close()
    assert time.monotonic() - started < 10.0
