"""Eviction policies beyond LRU, listed by name in ``kvtier.index.eviction.EVICTION_POLICIES``.

Owns ``LRFUPolicy`` (``"lrfu"``): a recency-and-frequency policy for prefix caches, self-tuning
to the tier it runs on. Each node keeps a decayed reference count ``C`` (each use adds 1; the
count decays by ``exp(-gap / tau)``) and the leaf with the lowest key ``t_ref + tau * ln C``
goes first, where ``t_ref`` is the node's last counted use and ``tau`` is the tier's measured
mean eviction age (an exponentially weighted mean over victims, in policy ticks). This is the
ranking an exponentially decaying reuse rate proportional to ``C`` implies: a node used twice
recently outlives a once-used one of the same age by ``tau * ln 2``. Because ``tau`` is measured,
not set, the policy behaves the same at any capacity and load.

Prefix structure, from first principles:

- only leaves are ranked (the index hands over evictable leaves only), so a path erodes from its
  tail; a parent is used at least as often as its children, so a shared head (a system prompt, a
  document) outlives the branches below it;
- a use counts once per request: when nodes expose the index's ``hits`` counter (requests that
  used the node), a touch counts only if ``hits`` grew, so the index touching a path again while
  it inserts changes nothing; without ``hits`` every touch counts;
- uses closer together than a quarter of ``tau`` are one burst (a correlated reference: the same
  prompt sent twice at once, a tool loop's rapid steps): they refresh recency but do not add to
  ``C``, so a burst does not keep a dead branch alive for long.

Engine thread only; no locking, no torch. ``pop_victim`` is O(log n) through a heap with lazy
deletion (stale entries are skipped, and the heap is rebuilt when it outgrows the leaf set).
"""

from __future__ import annotations

import math

from kvtier.index.eviction import EvictionPolicy, LeafHeap, Node


class LRFUPolicy(EvictionPolicy):
    """Least recently/frequently used leaf first, with the decay tied to the eviction age."""

    name = "lrfu"

    def __init__(self, correlation: float = 0.25, smoothing: float = 0.01) -> None:
        if not 0.0 <= correlation < 1.0 or not 0.0 < smoothing <= 1.0:
            raise ValueError("need 0 <= correlation < 1 and 0 < smoothing <= 1")
        self.correlation = correlation
        self.smoothing = smoothing
        self.tau = 0.0                        # mean eviction age in ticks (0 until one eviction)
        self._tick = 0
        self._ref_tick: dict[Node, int] = {}  # last counted use
        self._count: dict[Node, float] = {}   # decayed use count at _ref_tick
        self._hits: dict[Node, int] = {}      # the node's hits when last seen
        self._leaves = LeafHeap()

    # ---- the ranking ------------------------------------------------------------------------
    def _know(self, node: Node) -> None:
        self._ref_tick[node] = self._tick
        self._count[node] = 1.0
        self._hits[node] = getattr(node, "hits", 0)

    def _use(self, node: Node) -> None:
        """Count a use of a known node, unless it belongs to the burst of the previous one."""
        hits = getattr(node, "hits", None)
        if hits is not None:
            if hits <= self._hits[node]:
                return  # the index touched it again within the same use: nothing new
            self._hits[node] = hits
        gap = self._tick - self._ref_tick[node]
        tau = max(self.tau, 1.0)
        if gap >= self.correlation * self.tau:
            self._count[node] = 1.0 + self._count[node] * math.exp(-gap / tau)
        self._ref_tick[node] = self._tick

    def key(self, node: Node) -> float:
        """The node's rank: lower goes first."""
        return self._ref_tick[node] + self.tau * math.log(self._count[node])

    def _push(self, node: Node) -> None:
        self._leaves.push(node, self.key(node))

    # ---- the EvictionPolicy contract --------------------------------------------------------
    def touch(self, node: Node) -> None:
        self._tick += 1
        if node not in self._count:
            self._know(node)
        else:
            self._use(node)
        if node in self._leaves:
            self._push(node)

    def add(self, node: Node, pages: int) -> None:
        if node not in self._count:
            self._tick += 1
            self._know(node)
        self._push(node)

    def remove(self, node: Node) -> None:
        self._leaves.discard(node)

    def pop_victim(self) -> Node | None:
        node = self._leaves.pop_min()
        if node is not None:
            age = self._tick - self._ref_tick[node]
            self.tau = age if self.tau == 0.0 else self.tau + self.smoothing * (age - self.tau)
        return node

    def forget(self, node: Node) -> None:
        self._leaves.forget(node)
        for table in (self._ref_tick, self._count, self._hits):
            table.pop(node, None)

    def __len__(self) -> int:
        return len(self._leaves)

