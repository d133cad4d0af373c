"""The ``shadow`` policy and its miniature simulations: LRU exactly until a miniature proves a
head start better, the duel's choice follows the workload in both directions, the sampler is
deterministic and takes its share, and replays of opposite workloads end on the right side.

Nodes in the first tests are small stand-ins with the attributes ``RadixIndex`` nodes have
(``tokens``, ``pages``, ``children``, ``hits``); the last tests replay the real index.
"""

from __future__ import annotations

import random
from array import array

import pytest

from kvtier.index.eviction import EVICTION_POLICIES, LRUPolicy, make_eviction_policy
from kvtier.index.minisim import Duel, PageSampler
from kvtier.index.policy_shadow import ShadowPolicy
from kvtier.replay import synthetic
from kvtier.replay.simulator import ReplayConfig, replay

_ids = iter(range(1, 1 << 30))


class Run:
    """A node of a radix tree: ``pages`` one-token pages with fresh ids."""

    def __init__(self, pages: int = 1) -> None:
        self.tokens = array("I", [next(_ids) for _ in range(pages)]).tobytes()
        self.pages = pages
        self.children: dict[bytes, Run] = {}
        self.hits = 1


def test_shadow_is_the_registered_default_candidate():
    assert EVICTION_POLICIES["shadow"] == "kvtier.index.policy_shadow:ShadowPolicy"
    assert isinstance(make_eviction_policy("shadow"), ShadowPolicy)


def test_registry_is_explicit_importing_policy_modules_adds_nothing():
    before = dict(EVICTION_POLICIES)
    import kvtier.index.policies
    import kvtier.index.policy_retention  # noqa: F401

    assert before == EVICTION_POLICIES
    for name in EVICTION_POLICIES:
        assert make_eviction_policy(name).name == name


def _drive(policy, other, steps: int, seed: int) -> tuple[list, list]:
    """The same random add / touch / evict stream to two policies; both victim lists."""
    rng = random.Random(seed)
    nodes: list[Run] = []
    held: set[Run] = set()
    mine, theirs = [], []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.45 or not held:
            node = Run(rng.randint(1, 4))
            nodes.append(node)
            held.add(node)
            policy.add(node, node.pages)
            other.add(node, node.pages)
        elif roll < 0.8:
            node = rng.choice(sorted(held, key=id))
            node.hits += 1
            policy.touch(node)
            other.touch(node)
        else:
            a, b = policy.pop_victim(), other.pop_victim()
            mine.append(a)
            theirs.append(b)
            held.discard(a)
    return mine, theirs


def test_with_no_evidence_the_order_is_exactly_lru():
    shadow = ShadowPolicy()
    shadow.duel.z = float("inf")             # no miniature can ever win
    mine, theirs = _drive(shadow, LRUPolicy(), 3000, seed=1)
    assert mine == theirs
    assert shadow.weight == 0.0


def _stream(duel: Duel, returning: bool, rounds: int, seed: int) -> None:
    """A stream of new pages, 30 % of which come back once right away. When ``returning``,
    those come back three more times, each after a gap longer than LRU keeps a page; else
    they never return again, and 40 % of the others come back once, within LRU's reach."""
    rng = random.Random(seed)
    duel.resize(64)
    waiting: list[tuple[int, bytes, int]] = []
    for step in range(rounds):
        key = step.to_bytes(4, "little")
        duel.ref(key, 0)
        roll = rng.random()
        if roll < 0.3:
            duel.ref(key, 1)
            if returning:
                waiting.append((step + 100, key, 2))
        elif roll < 0.7 and not returning:
            waiting.append((step + 40, key, 1))
        while waiting and waiting[0][0] <= step:
            _, back, klass = waiting.pop(0)
            duel.ref(back, min(klass, 3))
            if returning and klass < 4:
                waiting.append((step + 100, back, klass + 1))


def test_duel_takes_a_head_start_when_returned_pages_return_again():
    duel = Duel((0.0, 2.0, 8.0), half_life=8.0, z=2.0)
    _stream(duel, returning=True, rounds=6000, seed=2)
    assert duel.choice > 0.0
    wins, losses = duel.leads()[duel.choice]
    assert wins > losses


def test_duel_stays_lru_when_returned_pages_never_come_back():
    duel = Duel((0.0, 2.0, 8.0), half_life=8.0, z=2.0)
    _stream(duel, returning=False, rounds=6000, seed=3)
    assert duel.choice == 0.0
    assert all(losses > wins for wins, losses in duel.leads().values())


def test_duel_refuses_a_grid_without_lru_first():
    with pytest.raises(ValueError, match="LRU"):
        Duel((2.0, 8.0), half_life=8.0, z=2.0)


def test_sampler_is_deterministic_and_takes_its_share():
    sampler = PageSampler()
    sampler.start(0.1)
    pages = array("I", range(40000)).tobytes()
    picked = sampler.pick(pages, 4)
    assert picked == sampler.pick(pages, 4)
    assert 0.09 < len(picked) / 40000 < 0.11
    everything = PageSampler()
    everything.start(1.0)
    assert len(everything.pick(pages[:400], 4)) == 100


def _served(trace, fraction: float, policy: str) -> float:
    tokens = max(int(trace.unique_blocks() * fraction), 2) * trace.block_tokens
    return replay(trace, ReplayConfig(tokens, policy=policy,
                                      block_tokens=trace.block_tokens)).served_share


def test_replay_gains_where_returned_pages_return_and_holds_lru_where_they_do_not():
    shape = synthetic.Shape(requests=1500)
    rag = synthetic.make("rag", shape)
    assert _served(rag, 0.02, "shadow") > _served(rag, 0.02, "lru") + 0.02
    fading = synthetic.make("multiturn", shape)
    for fraction in (0.02, 0.1):
        assert _served(fading, fraction, "shadow") >= _served(fading, fraction, "lru") - 0.002


def test_with_a_head_start_a_returned_leaf_outlives_newer_fresh_ones():
    policy = ShadowPolicy()
    old = Run(4)
    policy.add(old, 4)
    policy.add(Run(4), 4)
    policy.duel.choice = 2.0              # as if the miniatures had proven weight 2
    policy.set_weight(2.0)                # head start: 2 x 8 pages held per class
    old.hits += 1
    policy.touch(old)                     # came back while an evictable leaf: class 1
    newer = [Run(4) for _ in range(3)]
    for node in newer:
        policy.add(node, 4)
    victims = [policy.pop_victim() for _ in range(5)]
    assert victims.index(old) == 4
    lru = ShadowPolicy()
    for node in (old, *newer):
        lru.add(node, 4)
    assert lru.pop_victim() is old
