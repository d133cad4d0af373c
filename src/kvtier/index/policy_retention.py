"""A retention eviction policy for prefix caches: ``"retention"``.

Owns ``RetentionPolicy``. A prefix cache loses most of its room to pages that never come back,
and when it is small against the gaps between a conversation's turns, LRU evicts every
conversation shortly before it returns. Which conversations return is not known in advance, but
one that came back once comes back again far more often than a fresh one, so the policy gives
returned pages a head start and learns online how large that head start should be:

- a run's *class* is how many times it came back (0 for a fresh run, up to 3), counting returns
  across an eviction: an evicted run leaves a *ghost* (its first page's key, class and eviction
  time, in a bounded table), and a new run containing a ghost's page continues that count (a
  returning chain is re-inserted from wherever the cache lost it);
- a leaf's deadline is its last use plus ``weight * class * held`` (``held``: the pages the tier
  holds, so the head start is in cache-fulls of new content and scales with capacity and load),
  and the leaf with the earliest deadline goes first. Leaves sit in one heap per class ordered
  by last use, so a class's head start can change without re-keying anything;
- ``weight`` is steered by the ghosts, as ARC steers its split between recency and frequency: a
  ghost coming back within ``window`` cache-fulls of its eviction is a hit a larger cache would
  have had; a fresh one lowers the weight (fresh runs need more room), a returned one raises
  it, each step scaled by how rare ghosts of its kind are. With no returns the weight never
  matters (every class is 0) and the order is LRU;
- a run cut off by a split whose head was reused and whose own pages were not (a request
  diverged there, e.g. a partial last page replaced by the next turn) is evicted first.

Time is counted in pages first seen (the volume of new content). Reads ``hits`` (the index's
count of requests that used a node) and, when nodes have them, ``tokens``, ``pages`` and
``children``; with opaque nodes every touch counts as a return and there are no ghosts.
``pop_victim`` is O(classes + log n); touches and adds are O(log n), plus a ghost lookup per
page of a new run. Engine thread only; no locking, no torch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from kvtier.index.eviction import EvictionPolicy, LeafHeap, Node

CLASSES = 4          # came back 0, 1, 2, 3+ times


@dataclass(slots=True)
class _Run:
    """What the policy remembers about one node."""

    klass: int
    last_use: float
    hits: int
    pages: int
    dead: bool = False


class RetentionPolicy(EvictionPolicy):
    """Earliest deadline first; a leaf's deadline is its last use plus
    ``weight * class * held``, ``weight`` steered by which ghosts come back."""

    name = "retention"

    def __init__(self, weight: float = 1.0, step: float = 0.05, window: float = 2.0,
                 max_ghosts: int = 1 << 16) -> None:
        if weight <= 0 or not 0 < step < 1 or window <= 0 or max_ghosts < 0:
            raise ValueError("need weight > 0, 0 < step < 1, window > 0 and max_ghosts >= 0")
        self.weight = weight
        self.step = step
        self.max_ghosts = max_ghosts
        self.window = window
        self.clock = 0.0                 # pages first seen
        self.held = 0.0                  # pages this tier holds (born less evicted)
        self._runs: dict[Node, _Run] = {}
        #: first-page key -> (class, clock at eviction); oldest first
        self._ghosts: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._ghost_count = [0.0, 0.0]   # ghosts of fresh runs, of returned runs
        self._heaps = [LeafHeap() for _ in range(CLASSES)]
        self._dead = LeafHeap()

    def retention(self, klass: int) -> float:
        """How long past its last use a leaf of ``klass`` is kept ahead of a fresh one."""
        return self.weight * klass * max(self.held, 1.0)

    # ---- learning from ghosts --------------------------------------------------------------
    def _ghost_returned(self, klass: int, evicted_at: float) -> None:
        """A run evicted ``clock - evicted_at`` ago came back. Within one cache-full of new
        content a cache twice as large would have served it: give its kind more room (more
        weight when a returned run came back, less when a fresh one did), in proportion to how
        few ghosts of its kind there are (so each kind's ghosts pull equally per ghost)."""
        if self.clock - evicted_at > self.window * max(self.held, 1.0):
            return
        fresh, returned = (max(p, 1.0) for p in self._ghost_count)
        if klass == 0:
            self.weight *= math.exp(-self.step * max(returned / fresh, 1.0))
        else:
            self.weight *= math.exp(self.step * max(fresh / returned, 1.0))
        self.weight = min(max(self.weight, 1e-3), 1e3)

    def _remember(self, node: Node, run: _Run) -> None:
        tokens = getattr(node, "tokens", None)
        pages = getattr(node, "pages", 0)
        if not tokens or not pages or not self.max_ghosts:
            return
        key = bytes(tokens[:len(tokens) // pages])
        old = self._ghosts.pop(key, None)
        if old is not None:
            self._ghost_count[old[0] > 0] -= 1
        self._ghosts[key] = (run.klass, self.clock)
        self._ghost_count[run.klass > 0] += 1
        while self._ghosts:
            klass, evicted_at = next(iter(self._ghosts.values()))
            if (self.clock - evicted_at <= self.window * max(self.held, 1.0)
                    and len(self._ghosts) <= self.max_ghosts):
                break
            self._ghosts.popitem(last=False)
            self._ghost_count[klass > 0] -= 1

    # ---- runs ------------------------------------------------------------------------------
    @staticmethod
    def _page_keys(node: Node) -> list[bytes]:
        tokens = getattr(node, "tokens", None)
        pages = getattr(node, "pages", 0)
        if not tokens or not pages:
            return []
        step = len(tokens) // pages
        return [bytes(tokens[offset:offset + step]) for offset in range(0, len(tokens), step)]

    def _birth(self, node: Node, pages: int) -> _Run:
        self.clock += pages
        self.held += pages
        run = _Run(0, self.clock, getattr(node, "hits", 1) or 1, pages)
        for key in self._page_keys(node) if self._ghosts else ():
            ghost = self._ghosts.pop(key, None)
            if ghost is not None:  # a run evicted before it came back: continue its count
                self._ghost_count[ghost[0] > 0] -= 1
                self._ghost_returned(*ghost)
                run.klass = min(ghost[0] + 1, CLASSES - 1)
                break
        return run

    def _split_head(self, node: Node) -> _Run:
        """An unknown node that is touched is the head of a split: it takes over the known
        child's history; the child (the part the request did not use) is dead."""
        pages = getattr(node, "pages", 1) or 1
        for child in (getattr(node, "children", None) or {}).values():
            run = self._runs.get(child)
            if run is not None:
                self._mark_dead(child, run)
                return _Run(run.klass, run.last_use, run.hits, pages)
        self.clock += pages
        self.held += pages
        return _Run(0, self.clock, getattr(node, "hits", 1) or 1, pages)

    def _mark_dead(self, node: Node, run: _Run) -> None:
        run.dead = True
        if node in self._heaps[run.klass]:
            self._heaps[run.klass].discard(node)
            self._dead.push(node, run.last_use)

    def _push(self, node: Node, run: _Run) -> None:
        if run.dead:
            self._dead.push(node, run.last_use)
        else:
            self._heaps[run.klass].push(node, run.last_use)

    def _unlist(self, node: Node, run: _Run) -> bool:
        listed = node in self._heaps[run.klass] or node in self._dead
        self._heaps[run.klass].discard(node)
        self._dead.discard(node)
        return listed

    # ---- the EvictionPolicy contract -------------------------------------------------------
    def touch(self, node: Node) -> None:
        run = self._runs.get(node)
        if run is None:
            run = self._runs[node] = self._split_head(node)
        listed = self._unlist(node, run)
        hits = getattr(node, "hits", None)
        if hits is None or hits > run.hits:
            if self.clock > run.last_use:  # a use in the same tick is the same use
                run.klass = min(run.klass + 1, CLASSES - 1)
            run.hits = hits if hits is not None else run.hits + 1
            run.dead = False
        run.last_use = self.clock
        if listed:
            self._push(node, run)

    def add(self, node: Node, pages: int) -> None:
        run = self._runs.get(node)
        if run is None:
            run = self._runs[node] = self._birth(node, pages)
        self._push(node, run)

    def remove(self, node: Node) -> None:
        run = self._runs.get(node)
        if run is not None:
            self._unlist(node, run)

    def pop_victim(self) -> Node | None:
        node = self._dead.pop_min()
        if node is None:
            best: tuple[float, Node, int] | None = None
            for klass, heap in enumerate(self._heaps):
                top = heap.peek_min()
                if top is not None:
                    deadline = top[0] + self.retention(klass)
                    if best is None or deadline < best[0]:
                        best = (deadline, top[1], klass)
            if best is None:
                return None
            node = best[1]
            self._heaps[best[2]].discard(node)
            self._remember(node, self._runs[node])
        run = self._runs[node]
        self.held = max(self.held - (getattr(node, "pages", 0) or run.pages), 0.0)
        return node

    def forget(self, node: Node) -> None:
        run = self._runs.pop(node, None)
        if run is not None:
            self._heaps[run.klass].forget(node)
        self._dead.forget(node)

    def __len__(self) -> int:
        return len(self._dead) + sum(len(h) for h in self._heaps)

