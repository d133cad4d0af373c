"""Walks of the radix tree per request, counted by an instrumented index, and the walk reuse
that keeps them few (``RadixIndex.current`` / ``cut``)."""

from __future__ import annotations

from typing import Any

import pytest

from cache_support import P, assert_kv, make_cache, prompt, serve
from kvtier.index.radix import RadixIndex

#: Walks a request may make (match + load + commit + release). A match walks once; a load
#: reuses that walk while the index is unchanged, and walks again once after it inserts the
#: loaded pages; a commit walks, inserts, and walks again only when the insert changed the tree.
BOUNDS = {"miss": 5, "device_hit": 3, "host_hit": 5}
LOAD_BOUNDS = {"device_hit": 0, "host_hit": 2}


class Walks:
    """Counts ``match`` and ``insert`` calls (each walks from a root) on one index."""

    def __init__(self, index: RadixIndex) -> None:
        self.n = 0
        for name in ("match", "insert"):
            setattr(index, name, self._counting(getattr(index, name)))

    def _counting(self, inner: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return inner(*args, **kwargs)
        return call

    def during(self, fn: Any) -> int:
        before = self.n
        fn()
        return self.n - before


def test_a_request_walks_the_tree_no_more_than_the_design_allows() -> None:
    with make_cache() as cache:
        walks, tokens = Walks(cache.ctx.index), prompt(6, seed=1)
        counts = {"miss": walks.during(lambda: serve(cache, tokens))}
        assert cache.drain()
        counts["device_hit"] = walks.during(lambda: serve(cache, tokens))
        cache.ctx.index.clear("device")
        counts["host_hit"] = walks.during(lambda: serve(cache, tokens))
        assert counts == {k: min(v, BOUNDS[k]) for k, v in counts.items()}, counts
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
        assert loaded <= LOAD_BOUNDS[case]


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
