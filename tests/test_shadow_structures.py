"""The structures that keep the ``shadow`` policy cheap per call: the run heap (membership on
the run, lazy deletion, re-keying), the heap-ranked miniature, the batched duel (same
miniatures, decisions at most one batch late), ghosts swept in batches but aged where they are
looked up, and the fast page layout read.
"""

from __future__ import annotations

import random
from array import array

import pytest

from kvtier.index.eviction import page_layout
from kvtier.index.minisim import RESIZE_SLACK, ClassCache, Duel, LRUCache
from kvtier.index.policy_shadow import TRIM_EVERY, ShadowPolicy
from kvtier.index.shadow_runs import Run, RunHeap
from kvtier.keys import KEY_BYTES

_ids = iter(range(1, 1 << 30))


class Stub:
    """A stand-in node: ``pages`` one-token pages with fresh ids (no ``keys`` attribute)."""

    def __init__(self, pages: int = 1, tokens: bytes | None = None) -> None:
        self.tokens = tokens or array("I", [next(_ids) for _ in range(pages)]).tobytes()
        self.pages = pages
        self.children: dict[bytes, Stub] = {}
        self.hits = 1


def _run() -> Run:
    return Run(0, 0.0, 0.0, 1, 1)


# ---- RunHeap -------------------------------------------------------------------------------
def test_run_heap_matches_a_sorted_model_through_rekeys_discards_and_compaction():
    rng = random.Random(7)
    heap, runs, model = RunHeap(), {n: _run() for n in range(40)}, {}
    for _ in range(6000):
        node = rng.randrange(40)
        roll = rng.random()
        if roll < 0.5:
            key = rng.random()
            heap.push(node, runs[node], key)
            model[node] = key
        elif roll < 0.7:
            heap.discard(runs[node])
            model.pop(node, None)
        elif model:
            got = heap.pop()
            assert got is not None
            lowest = min(model.values())
            assert model[got[0]] == lowest and got[1] is runs[got[0]]
            del model[got[0]]
        assert len(heap) == len(model)
        assert len(heap._heap) <= 2 * len(model) + 65    # stale entries are compacted
        assert all((runs[n].entry is not None) == (n in model) for n in runs)


def test_run_heap_rekey_reorders_only_live_leaves():
    heap, runs = RunHeap(), {n: _run() for n in "abc"}
    for i, node in enumerate("abc"):
        runs[node].klass = i
        heap.push(node, runs[node], float(i))
    heap.discard(runs["a"])
    heap.rekey(lambda run: -float(run.klass))          # reverse the order
    assert [heap.pop()[0] for _ in range(2)] == ["c", "b"]
    assert heap.pop() is None and len(heap) == 0


# ---- miniatures ----------------------------------------------------------------------------
def test_class_cache_keeps_a_returned_page_for_its_head_start_and_holds_its_size():
    cache = ClassCache(2.0)
    cache.resize(4)
    cache.lead([b"old"], [1], [False])      # a returned page (class 1): deadline 1 + 2 * 4
    fresh = [bytes([i]) for i in range(8)]
    cache.lead(fresh, [0] * 8, [False] * 8)  # eight new pages through a 4-page cache
    assert len(cache) == 4
    assert b"old" in cache._deadline         # 8 misses later it is still there
    cache.lead([bytes([i]) for i in range(8, 12)], [0] * 4, [False] * 4)
    assert b"old" not in cache._deadline     # past its deadline it goes


def test_class_cache_counts_wins_and_losses_against_the_lru_answers():
    cache = ClassCache(2.0)
    cache.resize(8)
    cache.lead([b"a", b"b"], [0, 0], [False, False])
    wins, losses = cache.lead([b"a", b"c"], [1, 0], [False, True])
    assert (wins, losses) == (1, 1)          # a: hit here, LRU missed; c: the reverse
    with pytest.raises(ValueError, match="weight"):
        ClassCache(0.0)


def test_lru_miniature_shrinks_to_a_smaller_size_before_the_next_batch():
    lru = LRUCache()
    lru.capacity = 6
    assert lru.hits([bytes([i]) for i in range(6)]) == [False] * 6
    lru.capacity = 3
    assert lru.hits([bytes([5])]) == [True] and len(lru) == 3


class _ClassModel:
    """The ranking a ``ClassCache`` must keep, by brute force: on a miss with the cache full,
    drop pages with the lowest ``(deadline, class, reference)`` until one slot is free."""

    def __init__(self, weight: float) -> None:
        self.weight, self.capacity, self.clock, self.refs = weight, 1, 0, 0
        self.rank: dict[bytes, tuple[float, int, int]] = {}

    def lead(self, keys: list[bytes], classes: list[int], lru_hits: list[bool]) -> list[int]:
        wins = losses = 0
        for key, klass, lru_hit in zip(keys, classes, lru_hits, strict=True):
            if key in self.rank:
                wins += not lru_hit
            else:
                losses += lru_hit
                self.clock += 1
                while len(self.rank) >= self.capacity:
                    del self.rank[min(self.rank, key=self.rank.__getitem__)]
            self.refs += 1
            span = self.weight * self.capacity
            self.rank[key] = (self.clock + span * klass, klass, self.refs)
        return [wins, losses]


def test_miniatures_match_brute_force_models_through_resizes():
    """Both miniatures, against a model each, over random references while the size grows and
    shrinks between batches (a shrink takes effect at the next miss, or at once for LRU)."""
    rng = random.Random(11)
    cache, model = ClassCache(2.0), _ClassModel(2.0)
    lru, recency = LRUCache(), list[bytes]()
    for batch in range(400):
        if batch % 7 == 0:
            size = rng.choice([1, 2, 3, 5, 9, 16])
            cache.resize(size)
            model.capacity = lru.capacity = size
        n = rng.randint(1, 12)
        keys = [bytes([rng.randrange(24)]) for _ in range(n)]
        classes = [rng.randrange(4) for _ in range(n)]
        del recency[:max(len(recency) - lru.capacity, 0)]
        expected_hits = []
        for key in keys:
            expected_hits.append(key in recency)
            if key in recency:
                recency.remove(key)
            recency.append(key)
            del recency[:max(len(recency) - lru.capacity, 0)]
        assert lru.hits(keys) == expected_hits
        assert list(cache.lead(keys, classes, expected_hits)) == model.lead(keys, classes,
                                                                          expected_hits)
        assert set(cache._deadline) == set(model.rank)
        assert list(lru._pages) == recency


def _stream(seed: int, n: int) -> list[tuple[bytes, int]]:
    """New pages, 30 % of which come back at once and then three more times, each after a gap
    longer than a 64-page LRU keeps them: a head start wins here."""
    rng = random.Random(seed)
    out: list[tuple[bytes, int]] = []
    waiting: list[tuple[int, bytes, int]] = []
    for step in range(n):
        key = step.to_bytes(4, "little")
        out.append((key, 0))
        if rng.random() < 0.3:
            out.append((key, 1))
            waiting.append((step + 100, key, 2))
        while waiting and waiting[0][0] <= step:
            _, back, klass = waiting.pop(0)
            out.append((back, min(klass, 3)))
            if klass < 4:
                waiting.append((step + 100, back, klass + 1))
    return out


def test_batched_duel_decides_exactly_as_a_per_reference_duel_only_later():
    one, batched = Duel((0.0, 2.0, 8.0), 8.0, 2.0, batch=1), Duel((0.0, 2.0, 8.0), 8.0, 2.0)
    for duel in (one, batched):
        duel.resize(64)
    seen_one, seen_batched = [], []
    stream = _stream(5, 4000)
    for key, klass in stream:
        one.ref(key, klass)
        batched.ref(key, klass)
        seen_one.append(one.choice)
        seen_batched.append(batched.choice)
    assert len(batched._keys) < batched.batch     # the tail is queued, not yet simulated
    batched.flush()
    assert batched.refs == one.refs == len(stream)
    assert batched.lru._pages == one.lru._pages
    for a, b in zip(one.caches, batched.caches, strict=True):
        assert a._deadline == b._deadline and a.clock == b.clock
    # The batch is cut where a decision falls due, so the scores are the same ...
    for (w1, l1), (w2, l2) in zip(one.leads().values(), batched.leads().values(), strict=True):
        assert w2 == pytest.approx(w1, rel=1e-12) and l2 == pytest.approx(l1, rel=1e-12)
    # ... and every choice shows up at most one batch later.
    changes = [i for i in range(1, len(stream)) if seen_one[i] != seen_one[i - 1]]
    assert changes, "the stream should make the duel change its mind"
    for i in changes:
        assert seen_one[i] in seen_batched[i:i + batched.batch + 1]
    with pytest.raises(ValueError, match="batch"):
        Duel((0.0, 2.0), 8.0, 2.0, batch=0)


def test_references_wait_for_a_full_batch():
    duel = Duel((0.0, 2.0), 8.0, 2.0, batch=8)
    duel.resize(64)
    duel.refs_of([bytes([i]) for i in range(5)], 0)
    assert duel.refs == 0 and len(duel.lru) == 0
    duel.refs_of([bytes([i]) for i in range(5, 8)], 1)
    assert duel.refs == 8 and len(duel.lru) == 8 and not duel._keys


def test_miniatures_ignore_size_swings_below_the_slack():
    assert 4 / 256 < RESIZE_SLACK < 44 / 256   # the sizes below straddle it
    duel = Duel((0.0, 2.0), 8.0, 2.0, batch=1)
    duel.resize(256)
    duel.ref(b"a", 0)
    duel.resize(260)                        # 1.6 %, within the slack: the size stays
    duel.ref(b"b", 0)
    assert duel.lru.capacity == duel.caches[0].capacity == 256
    duel.resize(300)
    duel.ref(b"c", 0)
    assert duel.lru.capacity == duel.caches[0].capacity == 300


# ---- ghosts --------------------------------------------------------------------------------
def _evict_one(policy: ShadowPolicy, pages: int = 4) -> None:
    policy.add(Stub(pages), pages)
    assert policy.pop_victim() is not None


def test_a_ghost_restores_the_class_only_within_its_history_even_before_a_sweep():
    klass_again = {}
    for gap in (1, 20):
        policy = ShadowPolicy()
        old = Stub(4)
        policy.add(old, 4)
        policy.add(Stub(4), 4)
        assert policy.pop_victim() is old          # leaves a ghost of class 0
        for _ in range(gap):                       # fewer evictions than a sweep apart
            _evict_one(policy)
        assert gap < TRIM_EVERY and old.tokens[:4] in policy._ghosts
        again = Stub(4, tokens=old.tokens)         # the same content, inserted again
        policy.add(again, 4)
        klass_again[gap] = policy._runs[again].klass
    assert klass_again[1] == 1     # came back within two cache-fulls of new content
    assert klass_again[20] == 0    # 80 pages later, past 2 x 8 pages held


def test_ghost_sweeps_bound_memory_to_the_history():
    policy = ShadowPolicy()
    policy.add(Stub(4), 4)
    for _ in range(3 * TRIM_EVERY):
        _evict_one(policy)
    # held is about 8 pages, so ghosts older than 16 pages of new content (4 evictions) go
    # at each sweep; between sweeps at most TRIM_EVERY more pile up.
    assert len(policy._ghosts) <= TRIM_EVERY + 8


# ---- page layout ---------------------------------------------------------------------------
def test_page_layout_reads_keys_then_tokens_and_opaque_nodes_give_nothing():
    tokens = array("I", [1, 2, 3]).tobytes()
    keyed = Stub(3, tokens)
    keyed.keys = bytes(range(3 * KEY_BYTES))
    assert page_layout(keyed) == (keyed.keys, KEY_BYTES)
    assert page_layout(Stub(3, tokens)) == (tokens, 4)      # no keys attribute at all
    keyless = Stub(3, tokens)
    keyless.keys = b""
    assert page_layout(keyless) == (tokens, 4)
    assert page_layout(object()) == (b"", 0)
    empty = Stub(3, tokens)
    empty.pages = 0
    assert page_layout(empty) == (b"", 0)
