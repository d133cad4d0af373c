"""Walks of the radix tree per request, counted by an instrumented index, and the walk reuse
that keeps them to one (``RadixIndex.current``, ``cut``, ``extend``, ``insert(after=...)``)."""

from __future__ import annotations

from typing import Any

import pytest

from cache_support import LAYOUT, P, assert_kv, make_cache, prompt, serve
from kvtier.index.radix import RadixIndex
from kvtier.store.memory import MemoryStore

#: Walks a request makes (match + load + commit + release, the commit given the ``Loaded``):
#: the match walks once; the load follows that walk (its inserts of landed and loaded pages go
#: along it and hand back the walk as they left it); the commit continues the load's walk, and
#: the write policy's host copy and its completion follow the commit's.
WALKS = {"miss": 1, "device_hit": 1, "host_hit": 1, "disk_hit": 1}
LOAD_WALKS = {"device_hit": 0, "host_hit": 0}


class Walks:
    """Counts walks from a root on one index: every ``match`` call (``current``, ``boundary``
    and ``extend`` walk through it when they must), and every ``insert`` not given a walk to
    follow (``after``); an insert given one never starts from a root."""

    def __init__(self, index: RadixIndex) -> None:
        self.n = 0
        for name in ("match", "insert"):
            setattr(index, name, self._counting(getattr(index, name)))

    def _counting(self, inner: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.n += kwargs.get("after") is None
            return inner(*args, **kwargs)
        return call

    def during(self, fn: Any) -> int:
        before = self.n
        fn()
        return self.n - before


def test_a_request_walks_the_tree_once() -> None:
    with make_cache(stores={"disk": MemoryStore(LAYOUT.page_bytes)}) as cache:
        walks, tokens = Walks(cache.ctx.index), prompt(6, seed=1)
        counts = {"miss": walks.during(lambda: serve(cache, tokens))}
        assert cache.drain()
        counts["device_hit"] = walks.during(lambda: serve(cache, tokens))
        cache.ctx.index.clear("device")
        counts["host_hit"] = walks.during(lambda: serve(cache, tokens))
        cache.ctx.index.clear_tiers(("device", "host"))
        hit, loaded = serve(cache, tokens)  # served from the disk tier, and counted:
        assert hit.tokens_by_tier["disk"] == 6 * P and loaded.tokens == 6 * P
        cache.ctx.index.clear_tiers(("device", "host"))
        counts["disk_hit"] = walks.during(lambda: serve(cache, tokens))
        assert counts == WALKS, counts
        cache.check_integrity()


def test_a_commit_without_its_load_walks_once_more_and_indexes_the_same() -> None:
    with make_cache() as cache:
        tokens = prompt(6, seed=5)
        serve(cache, tokens[:3 * P])
        walks = Walks(cache.ctx.index)
        hit = cache.match(tokens)
        loaded = cache.load(hit)
        ids = loaded.device_page_ids + cache.allocate(3)
        cache.commit(tokens, ids)
        cache.release(loaded)
        assert walks.n == 2 and cache.device_prefix(tokens) == ids
        cache.check_integrity()


def test_a_commit_given_the_load_of_another_prompt_walks_its_own_tokens() -> None:
    with make_cache() as cache:
        first, second = prompt(4, seed=6), prompt(4, seed=7)
        serve(cache, first)
        other = cache.load(cache.match(first))
        ids = cache.allocate(4)
        walks = Walks(cache.ctx.index)
        cache.commit(second, ids, loaded=other)
        cache.release(other)
        assert walks.n == 1 and cache.device_prefix(second) == ids
        assert len(cache.device_prefix(first)) == 4
        cache.check_integrity()


@pytest.mark.parametrize("case", ["device_hit", "host_hit"])
def test_a_load_reuses_the_walk_of_its_match(case: str) -> None:
    with make_cache() as cache:
        tokens = prompt(6, seed=2)
        serve(cache, tokens)
        assert cache.drain()
        if case == "host_hit":
            cache.ctx.index.clear("device")
        hit = cache.match(tokens)
        walks = Walks(cache.ctx.index)
        loaded = walks.during(lambda: hit.__setattr__("loaded", cache.load(hit)))
        assert hit.loaded.tokens == 6 * P  # type: ignore[attr-defined]
        assert_kv(cache, tokens, hit.loaded.device_page_ids)  # type: ignore[attr-defined]
        cache.release(hit.loaded)  # type: ignore[attr-defined]
        assert loaded == LOAD_WALKS[case]


def test_a_hit_whose_tree_changed_before_its_load_walks_again_and_loads_right() -> None:
    with make_cache() as cache:
        tokens, other = prompt(6, seed=3), prompt(5, seed=4)
        serve(cache, tokens)
        assert cache.drain()
        hit = cache.match(tokens)
        serve(cache, tokens[:3 * P] + other[:3 * P])  # splits the first prompt's node
        walks = Walks(cache.ctx.index)
        loaded = cache.load(hit)
        assert walks.n >= 1 and loaded.tokens == 6 * P
        assert_kv(cache, tokens, loaded.device_page_ids)
        cache.release(loaded)
        cache.check_integrity()


def _tokens(*pages: int) -> list[int]:
    return [t for p in pages for t in [p] * 2]


def test_cut_splits_like_boundary_and_returns_the_walk_as_a_fresh_one_sees_it() -> None:
    index = RadixIndex(2, capacities={"host": 16})
    tokens = _tokens(*range(1, 9))
    index.insert(tokens, tier="host", ids=list(range(8)))
    match = index.match(tokens)
    node, after = index.cut(match, 3)
    fresh = index.match(tokens)
    assert node is not None and node.pages == 3 and after.version == index.version
    assert [(n, used) for n, used in after.path] == [(n, used) for n, used in fresh.path]
    assert after.ids("host") == fresh.ids("host") == list(range(8))
    assert index.current(after) is after and index.current(match) is not match


def test_current_walks_again_after_any_change_and_not_before() -> None:
    index = RadixIndex(2, capacities={"host": 16})
    tokens = _tokens(1, 2, 3)
    index.insert(tokens, tier="host", ids=[0, 1, 2])
    match = index.match(tokens)
    index.lock(index.boundary(tokens, 3), "host")   # a lock changes no walk
    assert index.current(match) is match
    index.insert(_tokens(1, 2, 3, 4), tier="host", ids=[0, 1, 2, 3], strict=False)
    again = index.current(match)
    assert again is not match and again.depth_of("host") == 3


def test_extend_continues_a_walk_over_longer_tokens_as_a_fresh_walk_sees_them() -> None:
    index = RadixIndex(2, capacities={"host": 16})
    index.insert(_tokens(1, 2, 3, 4), tier="host", ids=[0, 1, 2, 3])
    prompt_walk = index.match(_tokens(1, 2))           # ends inside the run of 4 pages
    walks = Walks(index)
    for longer in (_tokens(1, 2, 3, 4), _tokens(1, 2, 3), _tokens(1, 2, 7), _tokens(1)):
        got, fresh = index.extend(prompt_walk, longer), RadixIndex.match(index, longer)
        assert (got.pages, got.depth, got.path) == (fresh.pages, fresh.depth, fresh.path)
    assert walks.n == 0


def test_extend_walks_from_the_root_for_other_tokens_another_salt_or_a_stale_walk() -> None:
    index = RadixIndex(2, capacities={"host": 16})
    index.insert(_tokens(1, 2, 3), tier="host", ids=[0, 1, 2])
    walk = index.match(_tokens(1, 2))
    walks = Walks(index)
    assert walks.during(lambda: index.extend(walk, _tokens(5, 2, 3))) == 1
    assert walks.during(lambda: index.extend(walk, _tokens(1, 2, 3), salt="other")) == 1
    index.insert(_tokens(1, 2, 3, 4), tier="host", ids=[0, 1, 2, 3], strict=False)
    again: list[Any] = []
    assert walks.during(lambda: again.append(index.extend(walk, _tokens(1, 2, 3, 4)))) == 1
    assert again[0].depth_of("host") == 4 and again[0].version == index.version
