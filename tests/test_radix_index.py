"""Behaviours of the radix index: matching, inserting, splitting, locks, eviction, salts."""

from __future__ import annotations

import pytest

from kvtier.errors import PoolExhausted
from kvtier.index.radix import RadixIndex
from kvtier.keys import KeyNamespace, page_keys

P = 4  # tokens per page


def prompt(*pages: int) -> list[int]:
    """A prompt whose page i holds four copies of ``pages[i]`` (easy to read in failures)."""
    return [p for p in pages for _ in range(P)]


def put(index: RadixIndex, tokens: list[int], tier: str = "device", start: int = 0,
        salt: str | None = None) -> list[int]:
    stop = len(tokens) // P
    ids = index.allocate(tier, stop - start)
    result = index.insert(tokens, tier=tier, ids=ids, start=start, salt=salt)
    index.free(tier, result.unused_ids)
    return ids


@pytest.fixture
def index() -> RadixIndex:
    return RadixIndex(P, capacities={"device": 16, "host": 32})


def test_match_reports_depth_per_tier_and_ids(index: RadixIndex) -> None:
    ids = put(index, prompt(1, 2, 3))
    put(index, prompt(1, 2, 3, 4), tier="host")
    m = index.match(prompt(1, 2, 3, 4, 5))
    assert m.pages == 4
    assert m.depth == (3, 4, 0, 0)
    assert m.ids("device") == ids
    assert m.tokens_on("host") == 16
    index.check_integrity({"device": 0, "host": 0})


def test_match_does_not_mutate_the_tree(index: RadixIndex) -> None:
    put(index, prompt(1, 2, 3, 4))
    before = index.stats()
    m = index.match(prompt(1, 2, 9))
    assert m.pages == 2
    assert index.stats() == before  # no split happened
    assert [n.pages for n in index.iter_nodes()] == [4]


def test_hit_is_verified_against_tokens_not_keys(index: RadixIndex) -> None:
    ns = KeyNamespace("m", "f", "float32", "x", P)
    tokens = prompt(1, 2, 3)
    keys = page_keys(tokens, P, ns)
    index.insert(tokens, keys, tier="device", ids=index.allocate("device", 3))
    forged = prompt(1, 2, 3)
    forged[P + 1] = 77  # one token of page 1 differs
    m = index.match(forged)
    assert m.pages == 1
    assert m.keys() == keys[:1]
    assert m.last_key() == keys[0]


def test_partial_last_page_never_matches(index: RadixIndex) -> None:
    put(index, prompt(1, 2))
    assert index.match(prompt(1, 2)[:-1]).pages == 1
    result = index.insert(prompt(1, 2, 3)[:-1], tier="device", ids=[], start=2)
    assert result.taken == 0


def test_salts_isolate_keyspaces(index: RadixIndex) -> None:
    put(index, prompt(1, 2), salt="tenant-a")
    assert index.match(prompt(1, 2), salt="tenant-b").pages == 0
    assert index.match(prompt(1, 2)).pages == 0
    assert index.match(prompt(1, 2), salt="tenant-a").pages == 2
    index.check_integrity()


def test_insert_splits_a_node_and_keeps_its_ids(index: RadixIndex) -> None:
    ids = put(index, prompt(1, 2, 3, 4))
    other = put(index, prompt(1, 2, 7), start=2)
    assert sorted(n.pages for n in index.iter_nodes()) == [1, 2, 2]
    assert index.match(prompt(1, 2, 3, 4)).ids("device") == ids
    assert index.match(prompt(1, 2, 7)).ids("device") == ids[:2] + other
    index.check_integrity({"device": 0})


def test_insert_hands_back_ids_of_pages_already_held(index: RadixIndex) -> None:
    ids = put(index, prompt(1, 2))
    fresh = index.allocate("device", 3)
    result = index.insert(prompt(1, 2, 3), tier="device", ids=[ids[0], fresh[0], fresh[1]])
    assert result.unused_ids == [fresh[0]]
    assert result.taken == 1
    index.free("device", result.unused_ids + fresh[2:])
    index.check_integrity({"device": 0})


def test_tier_stays_prefix_closed(index: RadixIndex) -> None:
    put(index, prompt(1, 2, 3))
    with pytest.raises(ValueError, match="parent page"):
        index.insert(prompt(1, 2, 3), tier="host", ids=[0], start=2)
    lenient = index.insert(prompt(1, 2, 3), tier="host", ids=[5], start=2, strict=False)
    assert lenient.taken == 0 and lenient.unused_ids == [5]
    with pytest.raises(ValueError, match="not indexed"):
        index.insert(prompt(1, 2, 3, 4, 5), tier="device", ids=[0], start=4)


def test_eviction_takes_whole_lru_leaves_first(index: RadixIndex) -> None:
    put(index, prompt(1, 2, 3))
    put(index, prompt(1, 5, 6), start=1)
    put(index, prompt(1, 7), start=1)
    index.touch(index.match(prompt(1, 2, 3)))
    freed = index.evict("device", 1)
    assert freed == 2  # the whole LRU leaf [5, 6], never a part of it
    assert index.match(prompt(1, 5, 6)).depth_of("device") == 1
    assert index.match(prompt(1, 2, 3)).depth_of("device") == 3
    index.check_integrity({"device": 0})


def test_eviction_never_touches_a_locked_node(index: RadixIndex) -> None:
    put(index, prompt(1, 2, 3))
    put(index, prompt(4, 5))
    node = index.boundary(prompt(1, 2, 3), 2)
    index.lock(node, "device")
    assert index.sizes("device").protected == 2
    assert index.evict("device", 4) == 0  # only 3 evictable: all or nothing
    assert index.evict("device", 3) == 3
    assert index.match(prompt(1, 2, 3)).depth_of("device") == 2
    index.unlock(node, "device")
    assert index.evict("device", 2) == 2
    assert index.stats()["nodes"] == 0
    index.check_integrity({"device": 0})


def test_allocate_evicts_or_refuses_without_evicting(index: RadixIndex) -> None:
    put(index, prompt(*range(10)))
    locked = index.boundary(prompt(*range(10)), 4)
    index.lock(locked, "device")
    with pytest.raises(PoolExhausted):
        index.allocate("device", 13)  # 6 free + 6 evictable < 13
    assert index.sizes("device").resident == 10
    ids = index.allocate("device", 12)
    assert len(ids) == 12 and index.sizes("device").resident == 4
    index.check_integrity({"device": 12})


def test_drop_removes_a_subtree_and_orphans(index: RadixIndex) -> None:
    put(index, prompt(1, 2, 3))
    put(index, prompt(1, 2, 3), tier="host")
    put(index, prompt(1, 2, 4), start=2)
    node = index.boundary(prompt(1, 2), 2)
    assert index.drop(node, "device") == 4
    assert index.match(prompt(1, 2, 3)).depth == (0, 3, 0, 0)
    assert index.match(prompt(1, 2, 4)).pages == 2  # page 4 was only on device: gone
    index.check_integrity({"device": 0, "host": 0})


def test_evict_hook_runs_before_the_pages_go(index: RadixIndex) -> None:
    seen: list[tuple[int, str]] = []

    def write_back(node: object, tier: str) -> None:
        seen.append((index.match(prompt(1, 2)).depth_of(tier), tier))

    index.on_evict = write_back
    put(index, prompt(1, 2))
    index.evict("device", 2)
    assert seen == [(2, "device")]


def test_touch_counts_hits_and_refreshes_recency(index: RadixIndex) -> None:
    put(index, prompt(1))
    put(index, prompt(2))
    index.touch(index.match(prompt(1)))
    (node,) = index.match(prompt(1)).nodes()
    assert node.hits == 2  # created once, used once
    index.evict("device", 1)
    assert index.match(prompt(1)).pages == 1 and index.match(prompt(2)).pages == 0


def test_bookkeeping_only_store_tier_has_capacity_and_eviction() -> None:
    index = RadixIndex(1, capacities={"disk": 3})
    for first in (1, 2, 3, 4):
        ids = index.allocate("disk", 1)
        index.insert([first], tier="disk", ids=ids)
    assert index.sizes("disk").resident == 3
    assert index.match([1]).pages == 0 and index.match([4]).pages == 1
    index.check_integrity({"disk": 0})


def test_store_tier_without_capacity_takes_no_ids(index: RadixIndex) -> None:
    put(index, prompt(1, 2))
    index.insert(prompt(1, 2), tier="disk", stop=1)
    assert index.match(prompt(1, 2)).depth == (2, 0, 1, 0)
    with pytest.raises(ValueError, match="takes no page ids"):
        index.insert(prompt(1, 2), tier="disk", ids=[1], start=1)
    index.check_integrity({"device": 0})


def test_integrity_check_catches_a_broken_count(index: RadixIndex) -> None:
    put(index, prompt(1, 2))
    index.ledgers[0].resident += 1
    with pytest.raises(AssertionError, match="resident"):
        index.check_integrity()


def test_integrity_check_catches_a_broken_closure(index: RadixIndex) -> None:
    put(index, prompt(1, 2))
    index.insert(prompt(1, 2), tier="disk")
    head = index.boundary(prompt(1, 2), 1)
    head.res[2] = None  # a child on disk below a parent that is not
    head.mask &= ~4
    with pytest.raises(AssertionError, match="closure"):
        index.check_integrity()


def test_unlock_of_unlocked_node_is_refused(index: RadixIndex) -> None:
    put(index, prompt(1))
    node = index.boundary(prompt(1), 1)
    with pytest.raises(ValueError, match="unlocked"):
        index.unlock(node, "device")
