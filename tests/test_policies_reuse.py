"""The ``reuse`` policy: learned per-class return rates, ghosts, dead split stubs, LRU fallback.

Nodes here are small stand-ins with the attributes ``RadixIndex`` nodes have (``tokens``,
``pages``, ``parent``, ``children``, ``hits``); the last test replays a real index.
"""

from __future__ import annotations

from array import array

from kvtier.index.eviction import EVICTION_POLICIES, make_eviction_policy
from kvtier.index.policy_reuse import RETURNED, ReuseClassPolicy
from kvtier.replay.simulator import ReplayConfig, replay
from kvtier.replay.trace import Trace, TraceRequest


class Run:
    """A node of a radix tree: ``pages`` one-token pages with the given ids."""

    def __init__(self, ids: list[int], parent: Run | None = None) -> None:
        self.tokens = array("I", ids).tobytes()
        self.pages = len(ids)
        self.parent = parent
        self.children: dict[bytes, Run] = {}
        self.hits = 1
        if parent is not None:
            parent.children[self.tokens[:4]] = self


ROOT = Run([])
SHARED = Run([0], ROOT)   # a shared head (a system prompt)
_next_id = iter(range(1, 1 << 30))


def _born(policy: ReuseClassPolicy, pages: int, parent: Run = SHARED) -> Run:
    node = Run([next(_next_id) for _ in range(pages)], parent)
    policy.add(node, pages)
    return node


def _reuse(policy: ReuseClassPolicy, node: Run) -> None:
    node.hits += 1
    policy.touch(node)


def _warm(policy: ReuseClassPolicy, returning: int, dying: int, rounds: int = 30) -> None:
    """Runs of ``returning`` pages come back; runs of ``dying`` pages never do."""
    for _ in range(rounds):
        back = _born(policy, returning)
        _born(policy, dying)
        _reuse(policy, back)
        for _ in range(8):                # newer content: the others age before eviction
            _born(policy, 8)
        while policy.pop_victim() is not None:
            pass


def test_reuse_is_registered_by_name():
    assert "reuse" in EVICTION_POLICIES
    assert isinstance(make_eviction_policy("reuse"), ReuseClassPolicy)


def test_reuse_learns_which_class_of_run_comes_back():
    policy = ReuseClassPolicy(min_births=5, half_life=1e9)
    _warm(policy, returning=2, dying=32)
    assert policy.rate((1, 1)) > 0.8      # 2-page runs: all came back
    assert policy.rate((5, 1)) < 0.2      # 32-page runs: none did


def test_reuse_evicts_a_newer_run_of_a_dying_class_before_an_older_returning_one():
    policy = ReuseClassPolicy(min_births=5, half_life=1e9)
    _warm(policy, returning=2, dying=32)
    older = _born(policy, 2)
    newer = _born(policy, 32)
    assert policy.pop_victim() is newer
    assert policy.pop_victim() is older


def test_reuse_counts_a_run_that_returns_after_eviction_through_its_ghost():
    policy = ReuseClassPolicy(min_births=1, half_life=1e9)
    lost = _born(policy, 4)
    _born(policy, 8)
    assert policy.pop_victim() is lost
    policy.forget(lost)
    before = policy._returns.get((2, 1), 0.0)
    again = Run([int.from_bytes(lost.tokens[:4], "little"), 999_001, 999_002], SHARED)
    policy.add(again, again.pages)        # re-inserted from its first page on
    assert policy._returns[(2, 1)] == before + 1
    assert policy._runs[again].returned


def test_reuse_ranks_the_unused_tail_of_a_split_run_first():
    policy = ReuseClassPolicy()
    older = _born(policy, 1)
    stub = _born(policy, 1)               # newer than ``older``; its head is cut off below
    head = Run([next(_next_id)], SHARED)  # the index split the run: the head was used...
    head.children[stub.tokens[:4]] = stub
    stub.parent = head
    policy.touch(head)                    # ...the tail (a page the next turn replaced) was not
    assert policy.pop_victim() is stub
    assert policy.pop_victim() is older


def test_reuse_with_opaque_nodes_is_plain_lru():
    policy = ReuseClassPolicy()
    for node in ("a", "b", "c"):
        policy.add(node, 1)
    policy.touch("a")
    assert [policy.pop_victim() for _ in range(3)] == ["b", "c", "a"]


def test_reuse_returned_runs_have_their_own_class():
    policy = ReuseClassPolicy(min_births=1, half_life=1e9)
    node = _born(policy, 4)
    _reuse(policy, node)
    _reuse(policy, node)
    assert policy._births[RETURNED] == 1
    assert policy._returns[RETURNED] == 1


def _chat_trace(conversations: int, live: int = 6) -> Trace:
    """``live`` conversations at a time, each turn adding 2 blocks, interleaved with one-off
    12-block documents that are never seen again (the pattern that flushes an LRU cache)."""
    requests, t, chains = [], 0, {}
    for step in range(conversations * 3):
        conv = step % live + live * (step // (3 * live))
        chain = chains.get(conv, [0])
        chain = chains[conv] = chain + [10_000 * (conv + 1) + len(chain) + k for k in range(2)]
        requests.append(TraceRequest(t, 512 * len(chain), 10, tuple(chain)))
        doc = (0, *range(1_000_000 + 100 * step, 1_000_000 + 100 * step + 12))
        requests.append(TraceRequest(t + 1, 512 * len(doc), 10, doc))
        t += 2
    return Trace(tuple(requests), 512)


def test_reuse_serves_more_than_lru_when_long_one_off_runs_flush_the_cache():
    trace = _chat_trace(60)
    lru = replay(trace, ReplayConfig(40 * 512)).served_share
    ours = replay(trace, ReplayConfig(40 * 512, policy="reuse")).served_share
    assert ours > lru + 0.03
