"""The radix index against a plain model of prefixes, step by step (Hypothesis state machine).

The model keeps, per salt and tier, a dict from a prefix (a tuple of pages) to the page id the
tier holds for its last page. Every step checks the index against it and runs the index's own
``check_integrity`` (counts, prefix closure, policy membership, pool conservation).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import PoolExhausted
from kvtier.index.match import IndexMatch
from kvtier.index.radix import RadixIndex
from kvtier.index.residency import TIERS

P = 2
CAPACITY = {"device": 12, "host": 20, "disk": 30}
SALTS = ("", "b")
Prefix = tuple[int, ...]

pages_st = st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple)
tier_st = st.sampled_from(("device", "host", "disk", "remote"))


def _walk_of(m: IndexMatch) -> tuple:
    return m.pages, m.depth, m.version, [(id(node), used) for node, used in m.path]


def tokens_of(pages: Prefix) -> list[int]:
    return [p * 10 + j for p in pages for j in range(P)]


class IndexModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = RadixIndex(P, capacities=CAPACITY)
        self.model: dict[tuple[str, str], dict[Prefix, int | None]] = {
            (salt, tier): {} for salt in SALTS for tier in TIERS}
        self.locks: list[tuple[str, str, Prefix, object]] = []
        self.outside = dict.fromkeys(CAPACITY, 0)

    # ---- helpers -------------------------------------------------------------------------
    def held(self, salt: str, tier: str, pages: Prefix) -> int:
        """Model depth: leading pages of ``pages`` the tier holds."""
        table = self.model[(salt, tier)]
        depth = 0
        while depth < len(pages) and pages[:depth + 1] in table:
            depth += 1
        return depth

    def known(self, salt: str, pages: Prefix) -> int:
        return max(self.held(salt, tier, pages) for tier in TIERS)

    def resync_after_eviction(self) -> None:
        """Drop from the model what the index evicted; check locked prefixes survived."""
        for (salt, tier), table in self.model.items():
            for prefix in list(table):
                depth = self.index.match(tokens_of(prefix), salt).depth_of(tier)
                if depth < len(prefix):
                    del table[prefix]
        for salt, tier, prefix, _node in self.locks:
            if self.held(salt, tier, prefix) < len(prefix):
                raise AssertionError(f"locked {prefix} evicted from {tier}")

    # ---- rules ---------------------------------------------------------------------------
    @rule(pages=pages_st, tier=tier_st, salt=st.sampled_from(SALTS), data=st.data())
    def insert(self, pages: Prefix, tier: str, salt: str, data: st.DataObject) -> None:
        walk = data.draw(st.none() | st.integers(0, len(pages)))
        self._insert(pages, tier, salt, data.draw(st.integers(0, len(pages))), walk)

    def _insert(self, pages: Prefix, tier: str, salt: str, start: int,
                walk: int | None = None) -> None:
        """``walk``: insert after a walk of the first ``walk`` pages, made before the ids are
        allocated (so an eviction may have made it stale)."""
        before = None if walk is None else self.index.match(tokens_of(pages[:walk]), salt)
        fits = start <= self.known(salt, pages) and (
            start == 0 or self.held(salt, tier, pages) >= start)
        has_ids = tier in CAPACITY
        n = len(pages) - start
        if has_ids:
            try:
                ids = self.index.allocate(tier, n)
            except PoolExhausted:
                assert self.index.sizes(tier).free + self.index.sizes(tier).evictable < n
                return
            self.resync_after_eviction()
            fits = start <= self.known(salt, pages) and (
                start == 0 or self.held(salt, tier, pages) >= start)
        else:
            ids = None
        result = self.index.insert(tokens_of(pages), tier=tier, ids=ids, start=start, salt=salt,
                                   strict=False, after=before)
        if before is not None:  # the walk it hands back is the one a fresh match makes
            assert result.match is not None
            assert _walk_of(result.match) == _walk_of(self.index.match(tokens_of(pages), salt))
        table = self.model[(salt, tier)]
        expect_unused = []
        if fits:
            for k in range(start, len(pages)):
                given = None if ids is None else ids[k - start]
                if pages[:k + 1] in table:
                    if given is not None and table[pages[:k + 1]] != given:
                        expect_unused.append(given)
                else:
                    table[pages[:k + 1]] = given
        elif ids is not None:
            expect_unused = list(ids)
        assert result.unused_ids == expect_unused
        if has_ids:
            self.index.free(tier, result.unused_ids)

    @precondition(lambda self: any(self.model.values()))
    @rule(tail=st.lists(st.integers(0, 2), min_size=1, max_size=2).map(tuple), tier=tier_st,
          data=st.data())
    def extend_known(self, tail: Prefix, tier: str, data: st.DataObject) -> None:
        """Insert below a prefix some tier holds (node boundaries and splits get exercised)."""
        known = sorted((salt, prefix) for (salt, _t), table in self.model.items() for prefix in table)
        salt, prefix = data.draw(st.sampled_from(known))
        pages = prefix + tail
        if len(pages) <= 6:
            walk = data.draw(st.none() | st.integers(0, len(pages)))
            self._insert(pages, tier, salt, data.draw(st.integers(0, len(pages))), walk)

    @rule(pages=pages_st, salt=st.sampled_from(SALTS))
    def match(self, pages: Prefix, salt: str) -> None:
        m = self.index.match(tokens_of(pages), salt)
        assert m.pages == self.known(salt, pages)
        for tier in TIERS:
            depth = self.held(salt, tier, pages)
            assert m.depth_of(tier) == depth, tier
            if tier in CAPACITY:
                table = self.model[(salt, tier)]
                assert m.ids(tier) == [table[pages[:k + 1]] for k in range(depth)]

    @rule(pages=pages_st, salt=st.sampled_from(SALTS), tier=tier_st, data=st.data())
    def lock(self, pages: Prefix, salt: str, tier: str, data: st.DataObject) -> None:
        depth = self.held(salt, tier, pages)
        if depth == 0:
            return
        k = data.draw(st.integers(1, depth))
        node = self.index.boundary(tokens_of(pages), k, salt)
        self.index.lock(node, tier)
        self.locks.append((salt, tier, pages[:k], node))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        _salt, tier, _prefix, node = self.locks.pop(i)
        self.index.unlock(node, tier)

    @rule(tier=st.sampled_from(tuple(CAPACITY)), n=st.integers(1, 8))
    def evict(self, tier: str, n: int) -> None:
        before = self.index.sizes(tier)
        freed = self.index.evict(tier, n)
        if before.evictable < n:
            assert freed == 0 and self.index.sizes(tier) == before
        else:
            assert freed >= n
            assert self.index.sizes(tier).resident == before.resident - freed
        self.resync_after_eviction()

    @rule(pages=pages_st, salt=st.sampled_from(SALTS), tier=tier_st, data=st.data())
    def drop(self, pages: Prefix, salt: str, tier: str, data: st.DataObject) -> None:
        depth = self.held(salt, tier, pages)
        if depth == 0:
            return
        k = data.draw(st.integers(1, depth))
        node = self.index.boundary(tokens_of(pages), k, salt)
        if node.locks[TIERS.index(tier)]:
            return
        self.index.drop(node, tier)
        table = self.model[(salt, tier)]
        for prefix in list(table):
            if prefix[:k] == pages[:k]:
                del table[prefix]
        self.resync_after_eviction()

    @rule(tier=st.sampled_from(("device", "host")))
    def clear(self, tier: str) -> None:
        protected = self.index.sizes(tier).protected
        self.index.clear(tier)
        assert self.index.sizes(tier).resident == protected
        self.resync_after_eviction()

    @invariant()
    def integrity(self) -> None:
        self.index.check_integrity(self.outside)
        nodes = sum(1 for _ in self.index.iter_nodes())
        assert nodes <= sum(len(t) for t in self.model.values())

    def teardown(self) -> None:
        for _salt, tier, _prefix, node in self.locks:
            self.index.unlock(node, tier)
        self.index.check_integrity(self.outside)


IndexModel.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestRadixIndexStateMachine = IndexModel.TestCase
