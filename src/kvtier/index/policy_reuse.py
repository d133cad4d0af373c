"""A reuse-learning eviction policy for prefix caches: ``"reuse"``.

Owns ``ReuseClassPolicy``. A prefix cache loses most of its capacity to pages that never come
back (a conversation that ends, a one-off document); which ones is not known in advance, so the
policy learns it from the stream, per class of page, and shifts each page's LRU rank by how
much more (or less) often its class comes back than the average page:

- a page's class is fixed when its run first becomes a leaf: the run's length (log2 buckets:
  a short new tail is a chat turn, a long one a pasted document) and how deep its chain already
  is in turns (0: hangs off a shared head; 1, 2, 3+: continues a run that was itself a tail);
- every run born counts one birth of its class; its first reuse counts one return. Runs evicted
  before they return leave a *ghost* (the key of their first page, class and birth time; a
  bounded, age-limited table): a new run whose first page matches a ghost counts as a return
  of the ghost's class. So the learned return rate is not censored by the cache's own
  capacity: it sees returns up to the ghost horizon (``horizon`` eviction ages);
- counts decay by half every ``half_life`` eviction ages, so the estimate follows the workload;
- the rank is ``last_use + tau * ln(rate(class) / rate(all))``: ``tau`` is the tier's measured
  eviction age (as in ``lrfu``), so a class twice as likely to return survives ``tau * ln 2``
  longer; classes with too few observations use the average (no shift). A run that returned
  once is ranked by the return rate of returned runs.
- a run cut off by a split whose head was reused and whose own pages were not (the request
  diverged there: a partial last page replaced by the next turn) is ranked as dead.

Time is measured in pages first seen (the volume of new content), so ages scale with load.
Reads ``hits`` (the index's count of requests that used a node) and, when nodes have them,
``pages``, ``parent``, ``children`` and ``tokens``; with opaque nodes it degrades to LRU.
Engine thread only; no locking, no torch. ``pop_victim`` is O(log n) (heap, lazy deletion).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from kvtier.index.eviction import EvictionPolicy, LeafHeap, Node

SIZE_BUCKETS = 8
TURN_BUCKETS = 4
RETURNED = (-1, -1)
DEAD_SHIFT = -1e18


@dataclass(slots=True)
class _Run:
    """What the policy remembers about one node."""

    klass: tuple[int, int]
    born: float
    last_use: float
    hits: int
    turn: int
    returned: bool = False
    again: bool = False
    dead: bool = False


class ReuseClassPolicy(EvictionPolicy):
    """LRU shifted by the learned return rate of each page's class."""

    name = "reuse"

    def __init__(self, horizon: float = 8.0, half_life: float = 32.0, min_births: float = 20.0,
                 smoothing: float = 0.01, strength: float = 1.0) -> None:
        self.strength = strength
        self.horizon = horizon
        self.half_life = half_life
        self.min_births = min_births
        self.smoothing = smoothing
        self.tau = 0.0
        self.clock = 0.0
        self._runs: dict[Node, _Run] = {}
        self._births: dict[tuple[int, int], float] = {}
        self._returns: dict[tuple[int, int], float] = {}
        self._ghosts: OrderedDict[bytes, tuple[tuple[int, int], float]] = OrderedDict()
        self._next_decay = 0.0
        self._leaves = LeafHeap()

    # ---- learning --------------------------------------------------------------------------
    def _count(self, table: dict[tuple[int, int], float], klass: tuple[int, int]) -> None:
        table[klass] = table.get(klass, 0.0) + 1.0

    def _decay(self) -> None:
        if self.tau <= 0.0 or self.clock < self._next_decay:
            return
        if self._next_decay == 0.0:  # the first eviction age is known: start the schedule
            self._next_decay = self.clock + self.half_life * self.tau
            return
        for table in (self._births, self._returns):
            for klass in table:
                table[klass] *= 0.5
        self._next_decay = self.clock + self.half_life * self.tau

    def rate(self, klass: tuple[int, int]) -> float:
        """Learned share of runs of ``klass`` that come back (the average when unsure)."""
        total_b = sum(self._births.values())
        total_r = sum(self._returns.values())
        mean = (total_r + 1.0) / (total_b + 2.0)
        births = self._births.get(klass, 0.0)
        if births < self.min_births:
            return mean
        return (self._returns.get(klass, 0.0) + mean * 2.0) / (births + 2.0)

    def _shift(self, run: _Run) -> float:
        if run.dead:
            return DEAD_SHIFT
        total_b = sum(self._births.values())
        mean = (sum(self._returns.values()) + 1.0) / (total_b + 2.0)
        klass = RETURNED if run.returned else run.klass
        return self.strength * self.tau * math.log(self.rate(klass) / mean)

    # ---- classes ---------------------------------------------------------------------------
    @staticmethod
    def _first_page(node: Node) -> bytes | None:
        tokens = getattr(node, "tokens", None)
        pages = getattr(node, "pages", 0)
        if not tokens or not pages:
            return None
        return bytes(tokens[:len(tokens) // pages])

    def _ghost_in(self, node: Node) -> tuple[tuple[int, int], float] | None:
        """The ghost of an evicted run that starts at one of ``node``'s pages, if any (a
        returning chain is re-inserted from wherever the cache lost it, which can be above the
        evicted run's first page)."""
        if not self._ghosts:
            return None
        tokens = getattr(node, "tokens", None)
        pages = getattr(node, "pages", 0)
        if not tokens or not pages:
            return None
        step = len(tokens) // pages
        for offset in range(0, len(tokens), step):
            ghost = self._ghosts.pop(bytes(tokens[offset:offset + step]), None)
            if ghost is not None:
                return ghost
        return None

    def _turn_of_parent(self, node: Node) -> int:
        parent = getattr(node, "parent", None)
        if parent is None or getattr(parent, "parent", None) is None:
            return 0
        run = self._runs.get(parent)
        return run.turn + 1 if run is not None else 1

    def _birth(self, node: Node, pages: int) -> _Run:
        self.clock += pages
        turn = self._turn_of_parent(node)
        size = min(max(pages, 1).bit_length() - 1, SIZE_BUCKETS - 1)
        klass = (size, min(turn, TURN_BUCKETS - 1))
        run = _Run(klass, self.clock, self.clock, getattr(node, "hits", 1), turn)
        ghost = self._ghost_in(node)
        if ghost is not None:
            self._count(self._returns, ghost[0])
            run.returned = True
            self._count(self._births, RETURNED)
        else:
            self._count(self._births, klass)
        self._decay()
        return run

    def _split_head(self, node: Node) -> _Run:
        """An unknown node that is touched is the head of a split: it takes over the known
        child's history; the child (the part the request did not use) is dead."""
        children = getattr(node, "children", None) or {}
        for child in children.values():
            run = self._runs.get(child)
            if run is not None:
                head = _Run(run.klass, run.born, run.last_use, run.hits, run.turn, run.returned)
                run.dead = True
                if child in self._leaves:
                    self._push(child)
                return head
        return _Run((0, 0), self.clock, self.clock, getattr(node, "hits", 1), 0, True)

    def _reused(self, run: _Run) -> None:
        if not run.returned:
            run.returned = True
            self._count(self._returns, run.klass)
            self._count(self._births, RETURNED)
        elif not run.again:
            run.again = True
            self._count(self._returns, RETURNED)

    # ---- the EvictionPolicy contract -------------------------------------------------------
    def _push(self, node: Node) -> None:
        run = self._runs[node]
        self._leaves.push(node, run.last_use + self._shift(run))

    def touch(self, node: Node) -> None:
        run = self._runs.get(node)
        if run is None:
            run = self._runs[node] = self._split_head(node)
        hits = getattr(node, "hits", None)
        if hits is None or hits > run.hits:
            self._reused(run)
            run.hits = hits if hits is not None else run.hits + 1
            run.dead = False
        run.last_use = self.clock
        if node in self._leaves:
            self._push(node)

    def add(self, node: Node, pages: int) -> None:
        if node not in self._runs:
            self._runs[node] = self._birth(node, pages)
        self._push(node)

    def remove(self, node: Node) -> None:
        self._leaves.discard(node)

    def pop_victim(self) -> Node | None:
        node = self._leaves.pop_min()
        if node is not None:
            self._evicted(node)
        return node

    def _evicted(self, node: Node) -> None:
        run = self._runs[node]
        if not run.dead:
            age = self.clock - run.last_use
            self.tau = age if self.tau == 0.0 else self.tau + self.smoothing * (age - self.tau)
        key = self._first_page(node)
        if key is not None and not run.dead and not run.again:
            self._ghosts[key] = (RETURNED if run.returned else run.klass, run.born)
        self._expire_ghosts()

    def _expire_ghosts(self) -> None:
        limit = self.clock - self.horizon * max(self.tau, 1.0)
        while self._ghosts:
            _, (_, born) = next(iter(self._ghosts.items()))
            if born >= limit and len(self._ghosts) <= 1 << 18:
                break
            self._ghosts.popitem(last=False)

    def forget(self, node: Node) -> None:
        self._leaves.forget(node)
        self._runs.pop(node, None)

    def __len__(self) -> int:
        return len(self._leaves)

