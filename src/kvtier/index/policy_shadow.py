"""The default eviction policy: ``"shadow"``, retention classes tuned by miniature simulations.

Owns ``ShadowPolicy``. A run's *class* is how often it came back (0 for a fresh run, up to 3;
an evicted run leaves a ghost, its first page's key, so a chain re-inserted from where the cache
lost it keeps its count). A leaf's deadline is its last use plus ``weight * class * held``
(``held``: the pages the tier holds, so the head start is in cache-fulls of new content), and
the earliest deadline goes first; the unused back part of a split run (a request diverged
there) is ranked ``weight * held`` early. With weight 0 the order is exactly LRU.

Which weight is right depends on the workload (a head start that wins on one trace loses
several points on another), so the policy does not guess it: a ``Duel`` of miniature caches
(``kvtier.index.minisim``), one per weight of a fixed geometric grid with LRU first, replays
a hash-sampled share of the page references beside the tier, and the tier takes the weight of
the miniature that serves most over a recent window, but only while it beats the LRU
miniature by more than twice the noise; otherwise the tier is LRU. The sample rate is fixed at
the first eviction so that the miniatures hold ``sample_pages`` pages.

Time is counted in pages first seen. Reads ``hits``, ``pages``, ``tokens``, ``keys`` and
``children`` of a node where present; with opaque nodes it is plain LRU. Engine thread only; no
locking, no torch. All leaves sit in one heap keyed by their deadline (re-keyed, O(n), only
when the weight changes), so every call is O(log n) like LRU's, plus one dict operation per
miniature per sampled page.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.index.eviction import EvictionPolicy, LeafHeap, Node, page_layout
from kvtier.index.minisim import CLASSES, Duel, PageSampler

#: head starts tried, in cache-fulls of new content per class (LRU first).
WEIGHTS: tuple[float, ...] = (0.0, 2.0, 8.0)
TICK = 1e-9   # orders uses within one page-birth instant (far below one page)


@dataclass(slots=True)
class _Run:
    """What the policy remembers about one node."""

    klass: int
    last_use: float
    born: float
    hits: int
    pages: int
    sample: tuple[bytes, ...] | None = None
    first: bytes | None = None     # the first page's identity (the key of its ghost)
    boost: float = 0.0             # a cache hint's head start, in pages of new content
    dead: bool = False


class ShadowPolicy(EvictionPolicy):
    """Retention classes whose head start follows the best of several miniature caches."""

    name = "shadow"

    def __init__(self, weights: tuple[float, ...] = WEIGHTS, sample_pages: int = 256,
                 half_life: float = 8.0, z: float = 2.0, history: float = 2.0) -> None:
        if sample_pages < 16 or half_life <= 0 or z < 0 or history <= 0:
            raise ValueError("need sample_pages >= 16, half_life > 0, z >= 0, history > 0")
        self.sample_pages = sample_pages
        self.history = history
        self.weight = 0.0
        self.span = 0.0                  # weight * held, fixed between weight changes
        self.clock = 0.0                 # pages first seen
        self.held = 0.0                  # pages this tier holds (born less evicted)
        self._tick = 0
        self._runs: dict[Node, _Run] = {}
        self._ghosts: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._leaves = LeafHeap()
        self.sampler = PageSampler()
        self.duel = Duel(weights, half_life, z)

    def _now(self) -> float:
        self._tick += 1
        return self.clock + self._tick * TICK

    def deadline(self, run: _Run) -> float:
        """The leaf's rank: lower goes first."""
        return run.last_use + run.boost + (-self.span if run.dead else self.span * run.klass)

    # ---- the sampled stream ------------------------------------------------------------------
    def _resample(self, node: Node, run: _Run) -> tuple[bytes, ...]:
        """The node's sampled pages, recomputed when unknown or when a split changed it."""
        if not self.sampler.started:
            return ()
        buffer, step = page_layout(node)
        run.sample = self.sampler.pick(buffer, step) if step else ()
        run.pages = getattr(node, "pages", run.pages) or run.pages
        return run.sample

    def _feed(self, run: _Run, sample: tuple[bytes, ...]) -> None:
        for key in sample:
            self.duel.ref(key, run.klass)

    # ---- runs --------------------------------------------------------------------------------
    def _birth(self, node: Node, pages: int) -> _Run:
        self.clock += pages
        self.held += pages
        now = self._now()
        run = _Run(0, now, now, getattr(node, "hits", 1) or 1, pages)
        buffer, step = page_layout(node)
        run.first = buffer[:step] if step else None
        if self._ghosts and run.first is not None:
            ghost = self._ghosts.pop(run.first, None)
            if ghost is not None and self.clock - ghost[1] <= self.history * self.held:
                run.klass = min(ghost[0] + 1, CLASSES - 1)
        if self.sampler.started:
            run.sample = self.sampler.pick(buffer, step) if step else ()
            self._feed(run, run.sample)
        return run

    def _split_head(self, node: Node) -> _Run:
        """An unknown node that is touched is the head of a split: it takes over the known
        child's history (and its first page); the child (the part the request did not use) is
        dead."""
        pages = getattr(node, "pages", 1) or 1
        for child in (getattr(node, "children", None) or {}).values():
            run = self._runs.get(child)
            if run is not None:
                run.dead = True
                head = _Run(run.klass, run.last_use, run.born, run.hits, pages, first=run.first,
                            boost=run.boost)
                run.first = None
                if child in self._leaves:
                    self._leaves.push(child, self.deadline(run))
                return head
        self.clock += pages
        self.held += pages
        now = self._now()
        return _Run(0, now, now, getattr(node, "hits", 1) or 1, pages)

    # ---- the EvictionPolicy contract ---------------------------------------------------------
    def touch(self, node: Node) -> None:
        run = self._runs.get(node)
        if run is None:
            run = self._runs[node] = self._split_head(node)
        hits = getattr(node, "hits", None)
        if hits is None or hits > run.hits:
            if self.clock > run.born:  # a use in the birth instant is the same use
                run.klass = min(run.klass + 1, CLASSES - 1)
            run.hits = hits if hits is not None else run.hits + 1
            run.dead = False
            sample = run.sample
            if sample is None or run.pages != getattr(node, "pages", run.pages):
                sample = self._resample(node, run)
            if sample:
                self._feed(run, sample)
        self._tick += 1
        run.last_use = self.clock + self._tick * TICK
        if node in self._leaves:
            self._leaves.push(node, run.last_use + run.boost + self.span * run.klass)

    def add(self, node: Node, pages: int) -> None:
        run = self._runs.get(node)
        if run is None:
            run = self._runs[node] = self._birth(node, pages)
        self._leaves.push(node, self.deadline(run))

    def remove(self, node: Node) -> None:
        self._leaves.discard(node)

    def pop_victim(self) -> Node | None:
        node = self._leaves.pop_min()
        if node is None:
            return None
        run = self._runs[node]
        if not run.dead:
            self._remember(node, run)
        self._evicted(getattr(node, "pages", 0) or run.pages)
        return node

    def _evicted(self, pages: int) -> None:
        """One eviction: the tier is full, so ``held`` is its capacity; the first one fixes
        the sample rate, each one sizes the miniatures and takes the duel's weight."""
        if not self.sampler.started:
            self.sampler.start(self.sample_pages / max(self.held, 1.0))
        self.duel.resize(self.sampler.rate * self.held)
        if self.duel.choice != self.weight:
            self.set_weight(self.duel.choice)
        self.held = max(self.held - pages, 0.0)

    def set_weight(self, weight: float) -> None:
        """Take a new weight: re-key every leaf (O(n); the duel changes its mind rarely)."""
        self.weight = weight
        self.span = weight * max(self.held, 1.0)
        for node in self._leaves.nodes():
            self._leaves.push(node, self.deadline(self._runs[node]))

    def _remember(self, node: Node, run: _Run) -> None:
        key = run.first
        if key is None:
            buffer, step = page_layout(node)
            if not step:
                return
            key = buffer[:step]
        self._ghosts.pop(key, None)
        self._ghosts[key] = (run.klass, self.clock)
        limit = self.clock - self.history * max(self.held, 1.0)
        ghosts = self._ghosts
        while ghosts and (next(iter(ghosts.values()))[1] < limit or len(ghosts) > 1 << 16):
            ghosts.popitem(last=False)

    supports_boost = True

    def boost(self, node: Node, pages: float) -> None:
        run = self._runs.get(node)
        if run is None:
            return
        run.boost = max(float(pages), 0.0)
        if node in self._leaves:
            self._leaves.push(node, self.deadline(run))

    def forget(self, node: Node) -> None:
        self._leaves.forget(node)
        self._runs.pop(node, None)

    def __len__(self) -> int:
        return len(self._leaves)
