"""TieredCache.hold_host / save_host: an engine that copies between its memory and host pages."""

from __future__ import annotations

import pytest
import torch

from cache_support import LAYOUT, P, assert_kv, make_cache, pattern, prompt, serve, store_keys
from kvtier.store.memory import MemoryStore


class _Ticket:
    def __init__(self, done: bool = True) -> None:
        self.done = done
        self.waited = 0

    def is_done(self) -> bool:
        return self.done

    def wait(self, timeout_s: float | None = None) -> bool:
        self.waited += 1
        self.done = True
        return True


def _page(cache, host_id: int) -> torch.Tensor:
    return cache.host_pool.page(host_id).view(torch.float32).view(LAYOUT.page_shape())


def _filler(cache, tokens: list[int], ticket: _Ticket | None = None, calls: list | None = None):
    def fill(first: int, host_ids: list[int]) -> _Ticket:
        if calls is not None:
            calls.append((first, list(host_ids)))
        for i, host_id in enumerate(host_ids):
            page = first + i
            _page(cache, host_id).copy_(pattern(tokens[page * P:(page + 1) * P]))
        return ticket or _Ticket()
    return fill


def test_a_saved_prompt_is_served_from_host_byte_exact_and_reaches_the_store() -> None:
    disk = MemoryStore(LAYOUT.page_bytes)
    with make_cache(stores={"disk": disk}) as cache:
        tokens = prompt(5, seed=1, extra=3)
        assert cache.save_host(tokens, _filler(cache, tokens)) == 5
        assert cache.drain()
        hit = cache.match(tokens)
        assert hit.tokens_by_tier == {"device": 0, "host": 5 * P, "disk": 0, "remote": 0}
        assert disk.contains(store_keys(tokens)) == [True] * 5
        held = cache.hold_host(hit)
        assert held.tokens == 5 * P and held.pages == 5
        for page, host_id in enumerate(held.host_page_ids):
            assert torch.equal(_page(cache, host_id), pattern(tokens[page * P:(page + 1) * P]))
        cache.release(held)
        loaded = cache.load(cache.match(tokens))        # the device path reads the same bytes
        assert_kv(cache, tokens, loaded.device_page_ids)
        cache.release(loaded)
        counters = cache.stats()["counters"]
        assert counters["fill_host_total"] == 1 and counters["host_fill_pages_total"] == 5
        cache.check_integrity()


def test_only_the_pages_past_the_host_prefix_are_written() -> None:
    with make_cache() as cache:
        head = prompt(3, seed=2)
        serve(cache, head)
        assert cache.drain()
        longer = head + prompt(4, seed=3)
        calls: list = []
        assert cache.save_host(longer, _filler(cache, longer, calls=calls)) == 7
        assert [(first, len(ids)) for first, ids in calls] == [(3, 4)]
        # Held already: nothing is written.
        calls.clear()
        assert cache.save_host(longer, _filler(cache, longer, calls=calls)) == 7
        assert calls == []
        cache.check_integrity()


def test_pages_enter_the_index_only_once_the_write_is_done() -> None:
    with make_cache() as cache:
        tokens = prompt(4, seed=4)
        ticket = _Ticket(done=False)
        free = cache.index.sizes("host").free
        assert cache.save_host(tokens, _filler(cache, tokens, ticket)) == 4
        cache.poll()
        assert cache.match(tokens).tokens == 0
        assert cache.index.sizes("host").free == free - 4
        cache.check_integrity()
        ticket.done = True
        cache.poll()
        assert cache.match(tokens).tokens_by_tier["host"] == 4 * P
        cache.check_integrity()


def test_a_fill_that_raises_gives_its_pages_back() -> None:
    with make_cache() as cache:
        tokens = prompt(4, seed=5)
        free = cache.index.sizes("host").free

        def broken(first: int, host_ids: list[int]) -> _Ticket:
            raise RuntimeError("copy failed")

        with pytest.raises(RuntimeError):
            cache.save_host(tokens, broken)
        assert cache.index.sizes("host").free == free
        assert cache.match(tokens).tokens == 0
        cache.check_integrity()


def test_held_pages_stay_until_released_and_their_copy_is_waited_for() -> None:
    with make_cache(host_pages=8) as cache:
        tokens = prompt(4, seed=6)
        cache.save_host(tokens, _filler(cache, tokens))
        held = cache.hold_host(cache.match(tokens))
        held.ticket = _Ticket(done=False)
        others = prompt(8, seed=7)
        cache.save_host(others, _filler(cache, others))   # wants the whole host tier
        assert cache.match(tokens).tokens_by_tier["host"] == 4 * P
        cache.release(held)
        assert held.ticket.waited == 1
        cache.release(held)                                 # idempotent
        cache.save_host(others, _filler(cache, others))
        assert cache.match(others).tokens_by_tier["host"] == 8 * P
        assert cache.match(tokens).tokens == 0
        cache.check_integrity()


def test_a_hit_only_a_store_holds_lands_on_host_before_it_is_held() -> None:
    disk = MemoryStore(LAYOUT.page_bytes)
    with make_cache(stores={"disk": disk}) as cache:
        tokens = prompt(6, seed=8)
        cache.save_host(tokens, _filler(cache, tokens))
        assert cache.drain()
        cache.clear_tier("host")
        hit = cache.match(tokens)
        assert hit.tokens_by_tier["disk"] == 6 * P
        held = cache.hold_host(hit)
        assert held.pages == 6
        for page, host_id in enumerate(held.host_page_ids):
            assert torch.equal(_page(cache, host_id), pattern(tokens[page * P:(page + 1) * P]))
        cache.release(held)
        assert cache.match(tokens).tokens_by_tier["host"] == 6 * P
        cache.check_integrity()


def test_without_a_host_tier_save_host_is_refused() -> None:
    with make_cache(host_pages=0) as cache, pytest.raises(ValueError, match="host tier"):
        cache.save_host(prompt(2, seed=9), lambda first, ids: _Ticket())
