"""Miniature cache simulations over a spatially sampled page stream (SHARDS-style).

Owns ``PageSampler`` (which pages of a run are in the sample, by a fixed hash of the page's
identity, so the same content is sampled in every process and every run), ``ClassCache`` (a
page-level cache of a fixed capacity that ranks pages by ``last use + weight * class *
capacity``, the ranking of ``kvtier.index.policy_shadow``; weight 0 is plain LRU) and
``Duel``, which feeds one sampled reference stream to several such caches at once, keeps a
decayed hit score for each, and names the weight the real tier should use.

A cache of ``C`` pages fed a sample of rate ``R`` of the pages behaves like the full cache
scaled down (``R * C`` pages): the technique of miniature simulations (Waldspurger et al.,
ATC'17). Each miniature costs one dict operation per sampled reference, so a few of them run
beside the real tier for a fraction of its own cost. Engine thread only; no torch.
"""

from __future__ import annotations

import math
from collections import OrderedDict

CLASSES = 4   # a page came back 0, 1, 2 or 3+ times
UNSET = -1.0


class PageSampler:
    """Picks the pages in the sample by the first two bytes of each page's identity.

    A page's identity is its page key (a content hash, so its bytes are uniform) or, for nodes
    without keys, its token bytes (the replay's one-token pages are block ids). Reading the
    ``[0::step]`` and ``[1::step]`` byte columns is a C-level slice, so a run of any length
    is sampled with a handful of C calls; only sampled pages are copied out.
    """

    def __init__(self) -> None:
        self.rate = UNSET
        self._first = 0          # first byte below this: in the sample
        self._second = 0         # first byte equal to _first: second byte below this
        self._table = b""

    def start(self, rate: float) -> None:
        self.rate = min(max(rate, 0.0), 1.0)
        limit = min(int(self.rate * 65536), 65536)
        self._first, self._second = divmod(limit, 256)
        self._table = bytes(1 if b < self._first or (b == self._first and self._second)
                            else 0 for b in range(256))

    @property
    def started(self) -> bool:
        return self.rate >= 0.0

    def pick(self, buffer: bytes, step: int) -> tuple[bytes, ...]:
        """The sampled page identities of a run stored as consecutive ``step``-byte pages."""
        if self._first >= 256:
            return tuple(buffer[i:i + step] for i in range(0, len(buffer), step))
        marks = buffer[::step].translate(self._table)
        out = []
        at = marks.find(1)
        while at >= 0:
            page = buffer[at * step:(at + 1) * step]
            if page[0] < self._first or (step > 1 and page[1] < self._second):
                out.append(page)
            at = marks.find(1, at + 1)
        return tuple(out)


class ClassCache:
    """A page cache ranking pages by last use plus ``weight * class * capacity``.

    One ordered dict per class keeps its pages in last-use order (a reference moves a page to
    the end), so the victim is the oldest page of whichever class has the earliest deadline;
    with weight 0 one ordered dict holds every page (plain LRU). Time counts this cache's own
    misses (new content), as the real policy counts pages born.
    """

    __slots__ = ("weight", "capacity", "clock", "_lists", "_where")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.capacity = 1
        self.clock = 0
        self._lists: list[OrderedDict[bytes, int]] = [
            OrderedDict() for _ in range(CLASSES if weight else 1)]
        self._where: dict[bytes, int] = {}

    def ref(self, key: bytes, klass: int) -> bool:
        """Reference ``key`` (of ``klass``); True on a hit."""
        where = self._where
        lists = self._lists
        if not self.weight:
            klass = 0
        old = where.pop(key, None)
        if old is None:
            self.clock += 1
            if len(where) >= self.capacity:
                self._evict(lists, where)
        else:
            del lists[old][key]
        lists[klass][key] = self.clock
        where[key] = klass
        return old is not None

    def _evict(self, lists: list[OrderedDict[bytes, int]], where: dict[bytes, int]) -> None:
        """Make room for one page: drop the page with the earliest deadline."""
        while where and len(where) >= self.capacity:
            if len(lists) == 1:
                victim = lists[0]
            else:
                span = self.weight * self.capacity
                victim, best = lists[0], math.inf
                for klass, pages in enumerate(lists):
                    if pages:
                        deadline = next(iter(pages.values())) + span * klass
                        if deadline < best:
                            victim, best = pages, deadline
            del where[victim.popitem(last=False)[0]]

    def __len__(self) -> int:
        return len(self._where)


class Duel:
    """Several ``ClassCache`` weights on one sampled stream, compared with LRU pair by pair.

    ``weights[0]`` must be 0 (LRU, the safe choice). For each other weight the duel counts the
    references it hit and LRU missed (wins) and the reverse (losses), both halving every
    ``half_life`` miniature cache-fulls of references. A weight is chosen only while its wins
    exceed its losses by more than ``z`` standard deviations of that difference under the
    hypothesis that it is no better than LRU (McNemar's test: ``z * sqrt(wins + losses)``);
    the best such weight wins, and with none the choice is LRU.
    """

    def __init__(self, weights: tuple[float, ...], half_life: float, z: float) -> None:
        if not weights or weights[0] != 0.0:
            raise ValueError("the first weight must be 0 (LRU)")
        self.lru = ClassCache(0.0)
        self.caches = [ClassCache(w) for w in weights[1:]]
        self.wins = [0.0] * len(self.caches)
        self.losses = [0.0] * len(self.caches)
        self.half_life = half_life
        self.z = z
        self.choice = 0.0
        self.refs = 0
        self._next_decision = 0

    def resize(self, pages: float) -> None:
        capacity = max(int(round(pages)), 1)
        if capacity == self.lru.capacity:
            return
        self.lru.capacity = capacity
        for cache in self.caches:
            cache.capacity = capacity

    def ref(self, key: bytes, klass: int) -> None:
        """A reference to sampled page ``key``, of the class the real tier gave its run."""
        lru_hit = self.lru.ref(key, klass)
        for i, cache in enumerate(self.caches):
            if cache.ref(key, klass) is not lru_hit:
                if lru_hit:
                    self.losses[i] += 1.0
                else:
                    self.wins[i] += 1.0
        self.refs += 1
        if self.refs >= self._next_decision:
            self._decide()

    def _decide(self) -> None:
        """Every quarter miniature cache-full: pick the weight, then decay the counts."""
        step = max(self.lru.capacity // 4, 1)
        self._next_decision = self.refs + step
        keep = 0.5 ** (step / (self.half_life * self.lru.capacity))
        best, choice = 0.0, 0.0
        for i, cache in enumerate(self.caches):
            lead = self.wins[i] - self.losses[i]
            if lead > best and lead > self.z * math.sqrt(self.wins[i] + self.losses[i]):
                best, choice = lead, cache.weight
            self.wins[i] *= keep
            self.losses[i] *= keep
        self.choice = choice

    def leads(self) -> dict[float, tuple[float, float]]:
        """Each weight's decayed (wins, losses) against LRU."""
        return {c.weight: (self.wins[i], self.losses[i]) for i, c in enumerate(self.caches)}
