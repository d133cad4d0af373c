"""The default eviction policy: ``"shadow"``, retention classes tuned by miniature simulations.

Owns ``ShadowPolicy``. A run's *class* is how often it came back (0 for a fresh run, up to 3;
an evicted run leaves a ghost, its first page's key, so a chain re-inserted from where the cache
lost it keeps its count). A leaf's deadline is its last use plus ``weight * class * held``
(``held``: the pages the tier holds, so the head start is in cache-fulls of new content), and
the earliest deadline goes first; the unused back part of a split run (a request diverged
there) is ranked ``weight * held`` early. With weight 0 the order is exactly LRU.

Which weight is right depends on the workload (a head start that wins on one trace loses
several points on another), so the policy does not guess it: a ``Duel`` of miniature caches
(``kvtier.index.minisim``), one per weight of a fixed grid (LRU and one head start), replays
a hash-sampled share of the page references beside the tier, and the tier takes the weight of
the miniature that serves most over a recent window, but only while it beats the LRU
miniature by more than twice the noise; otherwise the tier is LRU. The sample rate is fixed at
the first eviction so that the miniatures hold ``sample_pages`` pages.

Time is counted in pages first seen. Reads ``hits``, ``pages``, ``tokens``, ``keys`` and
``children`` of a node where present; with opaque nodes it is plain LRU. Engine thread only; no
locking, no torch. All leaves sit in one ``RunHeap`` (``kvtier.index.shadow_runs``) keyed by
their deadline (re-keyed, O(n), only when the weight changes), so every call is O(log n) like
LRU's with one dict lookup (node to run); the sampled pages reach the miniatures in batches.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.index.eviction import EvictionPolicy, Node, page_layout
from kvtier.index.minisim import CLASSES, Duel, PageSampler
from kvtier.index.shadow_runs import Run, RunHeap

#: head starts tried, in cache-fulls of new content per class (LRU first).
WEIGHTS: tuple[float, ...] = (0.0, 4.0)
TICK = 1e-9       # orders uses within one page-birth instant (far below one page)
TOP_CLASS = CLASSES - 1
GHOSTS = 1 << 16  # ghosts kept at most
TRIM_EVERY = 64   # evictions between two sweeps of expired ghosts


class ShadowPolicy(EvictionPolicy):
    """Retention classes whose head start follows the best of several miniature caches."""

    name = "shadow"

    def __init__(self, weights: tuple[float, ...] = WEIGHTS, sample_pages: int = 128,
                 half_life: float = 8.0, z: float = 2.0, history: float = 2.0) -> None:
        if sample_pages < 16 or half_life <= 0 or z < 0 or history <= 0:
            raise ValueError("need sample_pages >= 16, half_life > 0, z >= 0, history > 0")
        self.sample_pages = sample_pages
        self.history = history
        self.weight = 0.0
        self.span = 0.0                  # weight * held, fixed between weight changes
        self.clock = 0.0                 # pages first seen
        self.held = 0.0                  # pages this tier holds (born less evicted)
        self._trim_in = 0
        self._tick = 0
        self._runs: dict[Node, Run] = {}
        self._ghosts: dict[bytes, tuple[int, float]] = {}  # oldest first
        self._leaves = RunHeap()
        self.sampler = PageSampler()
        self.duel = Duel(weights, half_life, z)

    def deadline(self, run: Run) -> float:
        """The leaf's rank: lower goes first."""
        return run.last_use + run.boost + (-self.span if run.dead else self.span * run.klass)

    # ---- runs --------------------------------------------------------------------------------
    def _birth(self, node: Node, pages: int) -> Run:
        """A run that just became a leaf for the first time: its ghost's class, its sample."""
        self.clock = clock = self.clock + pages
        self.held += pages
        self._tick = tick = self._tick + 1
        now = clock + tick * TICK
        run = Run(0, now, now, getattr(node, "hits", 1) or 1, pages)
        buffer, step = page_layout(node)
        if not step:
            return run
        run.first = first = buffer[:step]
        ghost = self._ghosts.pop(first, None)
        if ghost is not None and clock - ghost[1] <= self.history * self.held:
            run.klass = min(ghost[0] + 1, CLASSES - 1)
        sampler = self.sampler
        if sampler.rate >= 0.0:
            run.sample = sample = sampler.pick(buffer, step)
            if sample:
                self.duel.refs_of(sample, run.klass)
        return run

    def _split_head(self, node: Node) -> Run:
        """An unknown node that is touched is the head of a split: it takes over the known
        child's history (and its first page); the child (the part the request did not use) is
        dead."""
        pages = getattr(node, "pages", 1) or 1
        for child in (getattr(node, "children", None) or {}).values():
            run = self._runs.get(child)
            if run is not None:
                run.dead = True
                head = Run(run.klass, run.last_use, run.born, run.hits, pages, run.first,
                           run.boost)
                run.first = None
                if run.entry is not None:
                    self._leaves.push(child, run, self.deadline(run))
                return head
        self.clock += pages
        self.held += pages
        self._tick += 1
        now = self.clock + self._tick * TICK
        return Run(0, now, now, getattr(node, "hits", 1) or 1, pages)

    def _resample(self, node: Node, run: Run) -> Sequence[bytes]:
        """The node's sampled pages, picked when unknown or when a split changed the run
        (none before the sample rate is fixed)."""
        if self.sampler.rate < 0.0:
            return ()
        buffer, step = page_layout(node)
        run.sample = self.sampler.pick(buffer, step) if step else ()
        run.pages = getattr(node, "pages", run.pages) or run.pages
        return run.sample

    # ---- the EvictionPolicy contract ---------------------------------------------------------
    def touch(self, node: Node) -> None:
        run = self._runs.get(node)
        if run is None:
            run = self._runs[node] = self._split_head(node)
        try:
            hits, pages = node.hits, node.pages  # type: ignore[attr-defined]
        except AttributeError:                # an opaque node: every touch is a use
            hits, pages = getattr(node, "hits", None), getattr(node, "pages", run.pages)
        clock = self.clock
        if hits is None or hits > run.hits:   # a new use (not the index walking it again)
            if clock > run.born and run.klass < TOP_CLASS:  # a use in the birth instant
                run.klass += 1                              # is the same use
            run.hits = hits if hits is not None else run.hits + 1
            run.dead = False
            sample = run.sample
            if sample is None or run.pages != pages:
                sample = self._resample(node, run)
            if sample:
                self.duel.refs_of(sample, run.klass)
        self._tick = tick = self._tick + 1
        run.last_use = last = clock + tick * TICK
        if run.entry is not None:
            span = self.span
            self._leaves.push(node, run,
                              last + run.boost + (-span if run.dead else span * run.klass))

    def add(self, node: Node, pages: int) -> None:
        run = self._runs.get(node)
        if run is None:
            run = self._runs[node] = self._birth(node, pages)
        span = self.span
        self._leaves.push(node, run, run.last_use + run.boost
                          + (-span if run.dead else span * run.klass))

    def remove(self, node: Node) -> None:
        run = self._runs.get(node)
        if run is not None and run.entry is not None:
            self._leaves.discard(run)

    def pop_victim(self) -> Node | None:
        got = self._leaves.pop()
        if got is None:
            return None
        node, run = got
        if not run.dead:
            key = run.first
            if key is None:
                buffer, step = page_layout(node)
                key = buffer[:step] if step else None
            if key is not None:        # leave a ghost: the run's class, and when it left
                ghosts = self._ghosts
                ghosts.pop(key, None)
                ghosts[key] = (run.klass, self.clock)
        # The tier is full, so what it holds now is its size: the first eviction fixes the
        # sample rate, the latest one sizes the miniatures; the tier takes the duel's weight.
        held = self.held
        sampler, duel = self.sampler, self.duel
        if sampler.rate < 0.0:
            sampler.start(self.sample_pages / max(held, 1.0))
        duel.target = sampler.rate * held
        if duel.choice != self.weight:
            self.set_weight(duel.choice)
        self._trim_in = trim_in = self._trim_in - 1
        if trim_in <= 0:
            self._trim_ghosts()
        self.held = max(held - (getattr(node, "pages", 0) or run.pages), 0.0)
        return node

    def set_weight(self, weight: float) -> None:
        """Take a new weight: re-key every leaf (O(n); the duel changes its mind rarely)."""
        self.weight = weight
        self.span = weight * max(self.held, 1.0)
        self._leaves.rekey(self.deadline)

    def _trim_ghosts(self) -> None:
        """Drop expired ghosts (older than ``history`` fills; a ghost's age is also checked
        where it is looked up, so sweeping every ``TRIM_EVERY`` evictions only bounds memory)."""
        self._trim_in = TRIM_EVERY
        ghosts = self._ghosts
        limit = self.clock - self.history * max(self.held, 1.0)
        excess = len(ghosts) - GHOSTS
        expired: list[bytes] = []
        for key, (_, left) in ghosts.items():   # insertion order: the oldest ghost first
            if left >= limit and len(expired) >= excess:
                break
            expired.append(key)
        for key in expired:
            del ghosts[key]

    supports_boost = True

    def boost(self, node: Node, pages: float) -> None:
        run = self._runs.get(node)
        if run is None:
            return
        run.boost = max(float(pages), 0.0)
        if run.entry is not None:
            self._leaves.push(node, run, self.deadline(run))

    def forget(self, node: Node) -> None:
        run = self._runs.pop(node, None)
        if run is not None and run.entry is not None:
            self._leaves.discard(run)

    def __len__(self) -> int:
        return len(self._leaves)
