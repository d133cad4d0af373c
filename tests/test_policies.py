"""Eviction policies: the contract every registered policy keeps, LRU's ordering, LRFU's ranking.

The contract part runs each policy by name against the real ``RadixIndex`` (bookkeeping only)
with random requests and checks the index's integrity after every step.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.index.eviction import EVICTION_POLICIES, LRUPolicy, make_eviction_policy
from kvtier.index.policies import LRFUPolicy
from kvtier.index.radix import RadixIndex

NAMES = sorted(EVICTION_POLICIES)


class Hits:
    """A node that exposes the index's hit counter, as ``RadixIndex`` nodes do."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hits = 1

    def __repr__(self) -> str:
        return self.name


def test_lrfu_is_registered_by_name():
    assert "lrfu" in EVICTION_POLICIES
    assert isinstance(make_eviction_policy("lrfu"), LRFUPolicy)


def test_unknown_policy_name_is_refused_with_the_known_names():
    with pytest.raises(ConfigError, match="lrfu"):
        make_eviction_policy("nope")


@pytest.mark.parametrize("name", NAMES)
def test_policy_pops_each_held_leaf_once_then_none(name):
    policy = make_eviction_policy(name)
    nodes = [f"n{i}" for i in range(20)]
    for node in nodes:
        policy.touch(node)
        policy.add(node, 1)
    for node in nodes[:5]:
        policy.remove(node)
    policy.forget(nodes[5])
    assert len(policy) == 14
    popped = [policy.pop_victim() for _ in range(14)]
    assert sorted(popped) == sorted(nodes[6:])
    assert policy.pop_victim() is None
    assert len(policy) == 0


def _request_tokens(rng: random.Random) -> list[int]:
    head = rng.choice(([1, 2, 3, 4], [1, 2, 5, 6], [7, 8]))
    return head + [rng.randrange(3) for _ in range(rng.randrange(0, 6))]


def _run_requests(index: RadixIndex, rng: random.Random, steps: int) -> None:
    for _ in range(steps):
        tokens = _request_tokens(rng)
        match = index.match(tokens)
        hit = match.depth_of("device")
        anchor = match.path[-1][0] if match.path else None
        index.lock(anchor, "device")
        if len(tokens) > hit and index.can_allocate("device", len(tokens) - hit):
            ids = index.allocate("device", len(tokens) - hit)
            done = index.insert(tokens, tier="device", ids=ids, start=hit)
            index.free("device", done.unused_ids)
        index.unlock(anchor, "device")
        if hit:
            index.touch(index.match(tokens[:hit]))
        index.check_integrity()


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(6, 16))
def test_policy_keeps_the_index_consistent_under_random_requests(name, seed, capacity):
    index = RadixIndex(1, capacities={"device": capacity}, policies={"device": name})
    _run_requests(index, random.Random(seed), 40)
    sizes = index.sizes("device")
    assert sizes.resident <= capacity
    assert len(index.ledgers[0].policy) > 0 or sizes.evictable == 0


def test_lru_parent_exposed_by_eviction_goes_before_newer_leaves():
    lru = LRUPolicy()
    for node in ("parent", "child"):   # one request used parent then child
        lru.touch(node)
    lru.add("child", 1)
    for node in ("other",):            # a later request
        lru.touch(node)
        lru.add(node, 1)
    assert lru.pop_victim() == "child"
    lru.add("parent", 1)               # the index exposes the parent after its child left
    assert lru.pop_victim() == "parent"
    assert lru.pop_victim() == "other"


def test_lru_touch_moves_a_leaf_behind_the_others():
    lru = LRUPolicy()
    for node in ("a", "b", "c"):
        lru.add(node, 1)
    lru.touch("a")
    assert [lru.pop_victim() for _ in range(3)] == ["b", "c", "a"]


def _lrfu_with_tau(tau_ticks: int) -> LRFUPolicy:
    """An LRFU whose measured eviction age is ``tau_ticks`` (one warm-up eviction)."""
    policy = LRFUPolicy()
    policy.add("warm", 1)
    for _ in range(tau_ticks):
        policy.touch("tick")
    assert policy.pop_victim() == "warm"
    return policy


def test_lrfu_keeps_a_reused_leaf_over_a_newer_once_used_one():
    policy = _lrfu_with_tau(100)
    reused, fresh = Hits("reused"), Hits("fresh")
    policy.add(reused, 1)
    for _ in range(30):
        policy.touch("tick")
    reused.hits += 1
    policy.touch(reused)            # used again 30 ticks later: count ~1.7
    for _ in range(20):
        policy.touch("tick")
    policy.add(fresh, 1)            # newer, used once
    assert policy.pop_victim() is fresh
    assert policy.pop_victim() is reused


def test_lrfu_counts_one_use_per_request_when_nodes_expose_hits():
    policy = _lrfu_with_tau(100)
    node = Hits("n")
    policy.add(node, 1)
    for _ in range(50):
        policy.touch("tick")
    before = policy.key(node)
    policy.touch(node)              # the index touching the path again: no new hit
    policy.touch(node)
    assert policy.key(node) == before
    node.hits += 1
    policy.touch(node)
    assert policy.key(node) > before


def test_lrfu_burst_refreshes_recency_without_adding_frequency():
    policy = _lrfu_with_tau(100)
    node = Hits("n")
    policy.add(node, 1)
    policy.touch("tick")
    node.hits += 1
    policy.touch(node)              # 2 ticks later: within a quarter of tau, one burst
    assert policy.key(node) == pytest.approx(policy._ref_tick[node])
    for _ in range(60):
        policy.touch("tick")
    node.hits += 1
    policy.touch(node)              # 60 ticks later: a second use
    assert policy.key(node) > policy._ref_tick[node] + 0.3 * policy.tau


def test_lrfu_tau_follows_the_mean_eviction_age():
    policy = LRFUPolicy(smoothing=1.0)
    policy.add("a", 1)
    for _ in range(40):
        policy.touch("tick")
    policy.pop_victim()
    assert policy.tau == pytest.approx(41, abs=1)
