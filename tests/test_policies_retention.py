"""The ``retention`` policy: returned runs outlive fresh ones, ghosts carry a run's count across
an eviction, dead split stubs go first, the weight follows which ghosts come back, and on a
workload whose answer is known it serves more than LRU (deterministically).

Nodes in the first tests are small stand-ins with the attributes ``RadixIndex`` nodes have
(``tokens``, ``pages``, ``children``, ``hits``); the later tests replay a real index.
"""

from __future__ import annotations

from array import array

from kvtier.index.eviction import EVICTION_POLICIES, make_eviction_policy
from kvtier.index.policy_retention import RetentionPolicy
from kvtier.index.radix import RadixIndex
from kvtier.replay.simulator import ReplayConfig, replay
from kvtier.replay.trace import Trace, TraceRequest

_ids = iter(range(1, 1 << 30))


class Run:
    """A node of a radix tree: ``pages`` one-token pages with the given ids."""

    def __init__(self, ids: list[int] | None = None, pages: int = 1) -> None:
        ids = ids if ids is not None else [next(_ids) for _ in range(pages)]
        self.tokens = array("I", ids).tobytes()
        self.pages = len(ids)
        self.children: dict[bytes, Run] = {}
        self.hits = 1


def _born(policy: RetentionPolicy, pages: int = 1, ids: list[int] | None = None) -> Run:
    node = Run(ids, pages)
    policy.add(node, node.pages)
    return node


def _reuse(policy: RetentionPolicy, node: Run) -> None:
    node.hits += 1
    policy.touch(node)


def test_retention_is_registered_by_name():
    assert "retention" in EVICTION_POLICIES
    assert isinstance(make_eviction_policy("retention"), RetentionPolicy)


def test_fresh_runs_go_in_lru_order():
    policy = RetentionPolicy()
    nodes = [_born(policy) for _ in range(5)]
    assert [policy.pop_victim() for _ in range(6)] == [*nodes, None]


def test_a_returned_run_outlives_newer_fresh_runs():
    policy = RetentionPolicy()
    old = _born(policy, 4)
    _born(policy, 4)
    _reuse(policy, old)                        # came back once: class 1
    newer = [_born(policy, 4) for _ in range(3)]
    victims = [policy.pop_victim() for _ in range(3)]
    assert old not in victims                  # LRU would evict it second
    assert victims[1:] == newer[:2]


def test_a_ghost_carries_the_count_of_an_evicted_run_to_its_return():
    policy = RetentionPolicy()
    run = _born(policy, 2)
    _reuse(policy, run)
    assert policy.pop_victim() is run
    policy.forget(run)
    back = _born(policy, ids=[9, *run_ids(run)])   # the chain is re-inserted from one page up
    fresh = _born(policy, 2)
    assert policy.pop_victim() is fresh and policy.pop_victim() is back


def run_ids(node: Run) -> list[int]:
    return list(array("I", node.tokens))


def test_a_dead_split_stub_goes_before_anything_else():
    policy = RetentionPolicy()
    old = _born(policy, 2)
    stub = _born(policy, 3)
    head = Run(pages=2)                        # the index split ``stub``: ``head`` was used
    head.children[stub.tokens[:4]] = stub
    head.hits = stub.hits
    policy.remove(stub)
    policy.add(stub, stub.pages)
    policy.touch(head)
    head.hits += 1
    policy.touch(head)
    assert policy.pop_victim() is stub and policy.pop_victim() is old


def test_weight_moves_with_the_kind_of_ghost_that_comes_back():
    policy = RetentionPolicy()
    _born(policy, 64)
    fresh = _born(policy, 1)
    assert policy.pop_victim() is not None and policy.pop_victim() is fresh
    before = policy.weight
    _born(policy, ids=run_ids(fresh))          # a fresh run came back: less room for returns
    assert policy.weight < before


def _known_answer_trace() -> Trace:
    """Eight conversations that come back every 24 requests (each a 6-block context), under a
    stream of one-off 6-block requests that never return. A cache of 64 blocks holds the eight
    conversations, but in LRU order each is evicted by the ~100 new blocks between its turns."""
    requests, t, next_id = [], 0, 1000
    for rnd in range(30):
        for conv in range(8):
            base = [0, *range(conv * 100 + 1, conv * 100 + 6)]
            requests.append(TraceRequest(t, 6 * 512, 1, (*base, 50_000 + rnd * 8 + conv)))
            t += 1
            for _ in range(2):
                requests.append(TraceRequest(t, 7 * 512, 1, (0, *range(next_id, next_id + 6))))
                next_id += 6
                t += 1
    return Trace(tuple(requests), 512, "known-answer")


def test_retention_beats_lru_where_the_answer_is_known_and_is_deterministic():
    trace = _known_answer_trace()
    lru = replay(trace, ReplayConfig(64 * 512)).served_share
    first = replay(trace, ReplayConfig(64 * 512, policy="retention"))
    again = replay(trace, ReplayConfig(64 * 512, policy="retention"))
    assert first.served_share > lru + 0.05
    assert first.per_request == again.per_request and first.evicted_pages == again.evicted_pages


def test_retention_never_evicts_a_locked_path_or_an_inner_node():
    index = RadixIndex(1, capacities={"device": 12}, policies="retention")
    chain = array("I", range(1, 9)).tobytes()
    done = index.insert(chain, tier="device", ids=index.allocate("device", 8))
    index.touch(index.match(chain))
    index.lock(done.node, "device")
    other = array("I", [100, 101, 102, 103]).tobytes()
    index.insert(other, tier="device", ids=index.allocate("device", 4))
    assert index.evict("device", 8) == 0        # only 4 pages are evictable
    assert index.evict("device", 4) == 4
    assert index.match(chain).depth_of("device") == 8
    index.check_integrity()
