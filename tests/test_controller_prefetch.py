"""Prefetch policies against a slow store: timeout, wait_complete, best_effort, queue limits."""

from __future__ import annotations

import time
import uuid

from cache_support import LAYOUT, P, assert_kv, make_cache, prompt, serve
from kvtier.config import ControllerConfig
from kvtier.controller.prefetch import prefetch_budget_s
from kvtier.store.memory import MemoryStore
from kvtier.store.wrappers import FaultRule, FaultStore, LatencyStore


def seeded_disk(*prompts: list[int]) -> MemoryStore:
    """A disk store holding every page of ``prompts``, written by other cache instances (each
    cache closes its stores, so every instance gets its own handle on one named store)."""
    name = f"prefetch-{uuid.uuid4().hex}"
    for tokens in prompts:
        with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes, name=name)}) as writer:
            serve(writer, tokens)
            assert writer.drain()
    return MemoryStore(LAYOUT.page_bytes, name=name)


def test_timeout_budget_grows_with_tokens_and_is_capped() -> None:
    config = ControllerConfig()
    assert prefetch_budget_s(config, 0) == config.prefetch_timeout_base_s
    assert prefetch_budget_s(config, 10_000) == config.prefetch_timeout_base_s + 0.2
    assert prefetch_budget_s(config, 10**7) == config.prefetch_timeout_max_s


def test_prefetch_timeout_serves_exactly_the_landed_prefix_and_leaves_index_consistent() -> None:
    tokens = prompt(8, seed=1)
    slow = LatencyStore(seeded_disk(tokens), per_page_s=0.2)  # 2-page batches, 2 workers: 0.4 s
    with make_cache(stores={"disk": slow}, prefetch_policy="timeout",
                    prefetch_timeout_base_s=0.5, prefetch_timeout_per_1k_tokens_s=0.0) as cache:
        hit = cache.match(tokens)
        started = time.monotonic()
        loaded = cache.load(hit)
        assert time.monotonic() - started < 1.0
        assert 0 < loaded.tokens < 8 * P
        assert_kv(cache, tokens, loaded.device_page_ids)
        counters = cache.stats()["counters"]
        assert counters["prefetch_total"] == {"timeout": 1}
        assert counters["prefetch_served_pages_total"] == loaded.pages
        cache.check_integrity()
        cache.release(loaded)
        assert cache.drain(5.0)
        landed = loaded.pages
        assert cache.stats()["counters"]["prefetch_released_pages_total"] == 8 - landed
        assert cache.stats()["outside_index"] == {"device": 0, "host": 0}
        hit = cache.match(tokens)
        assert hit.tokens_by_tier == {"device": landed * P, "host": 0,
                                      "disk": (8 - landed) * P, "remote": 0}
        cache.check_integrity()


def test_wait_complete_serves_the_whole_prefix() -> None:
    tokens = prompt(8, seed=2)
    slow = LatencyStore(seeded_disk(tokens), per_page_s=0.02)
    with make_cache(stores={"disk": slow}, prefetch_policy="wait_complete") as cache:
        loaded = cache.load(cache.match(tokens))
        assert loaded.tokens == 8 * P
        assert_kv(cache, tokens, loaded.device_page_ids)
        assert cache.stats()["counters"]["prefetch_total"] == {"completed": 1}
        cache.release(loaded)
        cache.check_integrity()


def test_best_effort_never_waits_and_late_pages_land_in_host() -> None:
    tokens = prompt(8, seed=3)
    slow = LatencyStore(seeded_disk(tokens), per_page_s=0.1)
    with make_cache(stores={"disk": slow}, prefetch_policy="best_effort") as cache:
        hit = cache.match(tokens)  # (the latency store also slows this probe)
        started = time.monotonic()
        loaded = cache.load(hit)
        assert time.monotonic() - started < 0.15  # one 2-page read takes 0.2 s
        assert loaded.tokens < 8 * P
        cache.release(loaded)
        assert cache.drain(5.0)
        hit = cache.match(tokens)
        assert hit.reach("host") == 8 and hit.tokens_by_tier["disk"] == 0
        _, again = serve(cache, tokens)
        assert again.tokens == 8 * P
        cache.check_integrity()


def test_early_prefetch_is_used_by_the_later_load() -> None:
    tokens = prompt(8, seed=4)
    slow = LatencyStore(seeded_disk(tokens), per_page_s=0.01)
    with make_cache(stores={"disk": slow}, prefetch_policy="timeout",
                    prefetch_timeout_base_s=0.0, prefetch_timeout_per_1k_tokens_s=0.0) as cache:
        hit = cache.match(tokens)
        cache.prefetch(hit)
        time.sleep(0.3)  # the request waits in a queue while its pages land
        loaded = cache.load(hit)
        assert loaded.tokens == 8 * P
        assert_kv(cache, tokens, loaded.device_page_ids)
        cache.release(loaded)
        cache.check_integrity()


def test_store_part_below_min_prefetch_tokens_is_not_offered() -> None:
    tokens = prompt(3, seed=5)
    with make_cache(stores={"disk": seeded_disk(tokens)}, min_prefetch_tokens=4 * P) as cache:
        hit = cache.match(tokens)
        assert hit.tokens == 0
        assert cache.stats()["counters"]["prefetch_total"] == {"too_short": 1}


def test_hanging_store_neither_blocks_requests_nor_leaks_pages() -> None:
    tokens = [prompt(6, seed=10 + i) for i in range(3)]
    hanging = FaultStore(seeded_disk(*tokens), [FaultRule("read", "hang", hang_s=30)])
    with make_cache(stores={"disk": hanging}, io_workers=1, io_queue_depth=1,
                    prefetch_timeout_base_s=0.1, prefetch_timeout_per_1k_tokens_s=0.0) as cache:
        started = time.monotonic()
        for t in tokens:  # first hangs in the worker, second waits queued, third is refused
            loaded = cache.load(cache.match(t))
            assert loaded.tokens == 0
            cache.release(loaded)
        assert time.monotonic() - started < 2.0
        counters = cache.stats()["counters"]["prefetch_total"]
        assert counters == {"timeout": 2, "refused": 1}
        cache.check_integrity()
        hanging.release_hangs()
        assert cache.drain(5.0)
        assert cache.stats()["outside_index"]["host"] == 0
        assert cache.stats()["tiers"]["host"]["pages"] == 0
        cache.check_integrity()


def test_a_released_hit_gives_back_its_early_prefetch() -> None:
    tokens = prompt(8, seed=6)
    with make_cache(stores={"disk": LatencyStore(seeded_disk(tokens), per_page_s=0.01)}) as cache:
        hit = cache.match(tokens)
        cache.prefetch(hit)
        started = time.monotonic()
        assert cache.drain(5.0)  # the held job ends; draining does not wait for the hit
        assert time.monotonic() - started < 2.0
        assert cache.stats()["outside_index"]["host"] == 8  # still reserved for the hit
        cache.release(hit)
        assert cache.stats()["outside_index"]["host"] == 0
        assert cache.stats()["tiers"]["host"]["free"] == 64
        cache.check_integrity()


def test_landing_says_whether_a_load_now_would_wait_for_the_prefetch() -> None:
    tokens = prompt(8, seed=9)
    slow = LatencyStore(seeded_disk(tokens), per_page_s=0.05)  # 2-page batches: 0.1 s each
    with make_cache(stores={"disk": slow}, prefetch_policy="wait_complete") as cache:
        hit = cache.match(tokens)
        assert not cache.landing(hit)             # nothing started: a load would read itself
        cache.prefetch(hit)
        assert cache.landing(hit)
        deadline = time.monotonic() + 10
        while cache.landing(hit) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not cache.landing(hit)
        loaded = cache.load(hit)                  # served from what the prefetch landed
        assert loaded.tokens == 8 * P
        assert cache.stats()["counters"]["prefetch_total"] == {"completed": 1}
        assert_kv(cache, tokens, loaded.device_page_ids)
        cache.release(loaded)
    slow = LatencyStore(seeded_disk(tokens), per_page_s=0.05)
    with make_cache(stores={"disk": slow}, prefetch_policy="timeout",
                    prefetch_timeout_base_s=0.0, prefetch_timeout_per_1k_tokens_s=0.0) as cache:
        hit = cache.match(tokens)
        cache.prefetch(hit)
        assert not cache.landing(hit)             # a zero budget: the load would not wait
        cache.release(hit)
