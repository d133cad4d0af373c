"""TieredCache.commit_tail: a prompt's new pages go straight to host after a head held on host."""

from __future__ import annotations

import pytest

from cache_support import LAYOUT, P, assert_kv, make_cache, prompt, serve, store_keys, write_kv
from kvtier.store.memory import MemoryStore


def _host_only(cache, tokens: list[int]) -> None:
    """Push ``tokens``' pages off the device tier (they stay on host)."""
    cache.drain()
    cache.clear_tier("device")
    hit = cache.match(tokens)
    assert hit.tokens_by_tier["device"] == 0 and cache.host_pages(hit) == len(tokens) // P


def _tail(cache, tokens: list[int], first: int) -> tuple[int, list[int]]:
    """Copy pages [first, full) of ``tokens`` into fresh device pages and commit them to host."""
    full = len(tokens) // P
    fresh = cache.allocate(full - first)
    write_kv(cache, tokens, fresh, first)
    return cache.commit_tail(tokens, fresh, first), fresh


def test_a_tail_extends_the_host_prefix_and_serves_the_whole_prompt_byte_exact() -> None:
    disk = MemoryStore(LAYOUT.page_bytes)
    with make_cache(stores={"disk": disk}) as cache:
        assert cache.tail_commits
        head = prompt(4, seed=1)
        serve(cache, head)
        _host_only(cache, head)
        longer = head + prompt(3, seed=2, extra=2)
        stored, _ = _tail(cache, longer, 4)
        assert stored == 3
        assert cache.drain()
        hit = cache.match(longer)
        # Host only: nothing went onto the device tier; the store got every page behind it.
        assert hit.tokens_by_tier == {"device": 0, "host": 7 * P, "disk": 0, "remote": 0}
        assert disk.contains(store_keys(longer)) == [True] * 7
        loaded = cache.load(hit)
        assert_kv(cache, longer, loaded.device_page_ids)
        cache.release(loaded)
        stats = cache.stats()["counters"]
        assert stats["commit_tail_total"] == 1 and stats["commit_tail_pages_total"] == 3
        cache.check_integrity()


def test_scratch_pages_come_back_once_the_copy_is_over(monkeypatch) -> None:
    from kvtier.transfer.copy_engine import Ticket

    with make_cache(device_pages=16) as cache:
        head = prompt(4, seed=3)
        serve(cache, head)
        _host_only(cache, head)
        free_before = cache.index.sizes("device").free
        longer = head + prompt(5, seed=4)
        landed = {"yes": False}
        monkeypatch.setattr(Ticket, "is_done", lambda self: landed["yes"])
        stored, _ = _tail(cache, longer, 4)
        assert stored == 5
        cache.poll()
        # In flight: the copy holds its 5 device pages and 5 host pages, neither in the index.
        assert cache.index.sizes("device").free == free_before - 5
        assert cache.match(longer).tokens == 4 * P
        cache.check_integrity()
        landed["yes"] = True
        cache.poll()
        assert cache.match(longer).tokens == 9 * P
        assert cache.index.sizes("device").free == free_before
        assert cache.match(longer).tokens_by_tier["device"] == 0
        cache.check_integrity()


def test_pages_the_host_holds_already_are_not_copied_again() -> None:
    with make_cache() as cache:
        head = prompt(6, seed=5)
        serve(cache, head)
        _host_only(cache, head)
        stored, _ = _tail(cache, head + prompt(1, seed=6), 3)   # pages 3..5 are on host
        assert stored == 4
        assert cache.drain()
        assert cache.stats()["counters"]["host_copy_pages_total"] == 6 + 1
        hit = cache.match(head + prompt(1, seed=6))
        assert cache.host_pages(hit) == 7
        cache.check_integrity()


def test_a_head_the_host_lost_stores_nothing_and_frees_the_pages() -> None:
    with make_cache() as cache:
        head = prompt(4, seed=7)
        serve(cache, head)
        cache.drain()
        cache.flush()                    # device and host dropped: no head on host
        free_before = cache.index.sizes("device").free
        stored, _ = _tail(cache, head + prompt(2, seed=8), 4)
        assert stored == 0
        assert cache.drain()
        assert cache.index.sizes("device").free == free_before
        assert cache.match(head + prompt(2, seed=8)).tokens == 0
        cache.check_integrity()


def test_commit_tail_refuses_what_it_cannot_take() -> None:
    with make_cache() as cache:
        tokens = prompt(4, seed=9)
        fresh = cache.allocate(2)
        with pytest.raises(ValueError, match="got 2 page ids"):
            cache.commit_tail(tokens, fresh, 1)
        with pytest.raises(ValueError, match="not handed out"):
            cache.commit_tail(tokens, [fresh[0], 999], 2)
        cache.free(fresh)
    with make_cache(write_policy="write_back") as cache:
        assert not cache.tail_commits
        with pytest.raises(ValueError, match="write_through"):
            cache.commit_tail(prompt(2, seed=10), cache.allocate(1), 1)
