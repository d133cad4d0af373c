"""Eviction and admission policy interfaces, and the LRU reference policy.

Owns the small contract between the radix index and the policies that decide what a tier keeps:
the index tells a tier's ``EvictionPolicy`` which nodes are evictable leaves *of that tier*
(``add``/``remove``), which nodes were used (``touch``), and which left the index for good
(``forget``); when the tier needs room it asks ``pop_victim``. Policies hold node references
only as opaque hashable objects, plus whatever history they keep (bounded); the one thing a
policy may read from a node is an integer ``hits`` attribute when the node has one (the radix
index's count of requests that used it), with ``getattr(node, "hits", None)``. An
``AdmissionPolicy`` decides whether a page is worth copying down to a lower tier at all.
Everything here runs on the engine thread; no locking, no torch. Policies beyond LRU live in
``kvtier.index.policies`` and are looked up by name with ``make_eviction_policy``.
"""

from __future__ import annotations

import heapq
import importlib
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

Node = Hashable


class EvictionPolicy(ABC):
    """Chooses the next victim among one tier's evictable leaves."""

    name: str = ""

    @abstractmethod
    def add(self, node: Node, pages: int) -> None:
        """``node`` (holding ``pages`` pages on this tier) became an evictable leaf of the tier."""

    @abstractmethod
    def remove(self, node: Node) -> None:
        """``node`` stopped being an evictable leaf (locked, got a child, evicted). Idempotent."""

    @abstractmethod
    def touch(self, node: Node) -> None:
        """``node`` was used by a request (called for every node of a matched or inserted path,
        evictable or not)."""

    @abstractmethod
    def pop_victim(self) -> Node | None:
        """Remove and return the next leaf to evict, or None when nothing is evictable."""

    def forget(self, node: Node) -> None:  # noqa: B027 - optional hook, default no history
        """``node`` left the index for good: drop any history kept about it."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable leaves the policy holds."""


class LRUPolicy(EvictionPolicy):
    """Least recently used leaf first: the reference every other policy is measured against.

    Leaves are ordered by their last ``touch``, not by when they became leaves: a parent exposed
    by its child's eviction was used no later than that child, so it is next in line, not the
    most recent. (Ordering by ``add`` time spreads evictions one page at a time over every path
    and serves visibly less on real traces.) A heap with lazy deletion keeps ``pop_victim``
    O(log n); stale entries are dropped when popped or when the heap is rebuilt.
    """

    name = "lru"

    def __init__(self) -> None:
        self._clock = 0
        self._stamp: dict[Node, int] = {}
        self._leaves: set[Node] = set()
        self._heap: list[tuple[int, Node]] = []  # stamps are unique: nodes are never compared

    def _push(self, node: Node) -> None:
        if node not in self._stamp:
            self._clock += 1
            self._stamp[node] = self._clock
        heapq.heappush(self._heap, (self._stamp[node], node))
        if len(self._heap) > 2 * len(self._leaves) + 64:
            self._heap = [(self._stamp[n], n) for n in self._leaves]
            heapq.heapify(self._heap)

    def add(self, node: Node, pages: int) -> None:
        self._leaves.add(node)
        self._push(node)

    def remove(self, node: Node) -> None:
        self._leaves.discard(node)

    def touch(self, node: Node) -> None:
        self._clock += 1
        self._stamp[node] = self._clock
        if node in self._leaves:
            self._push(node)

    def pop_victim(self) -> Node | None:
        while self._heap:
            stamp, node = heapq.heappop(self._heap)
            if node in self._leaves and self._stamp[node] == stamp:
                self._leaves.discard(node)
                return node
        return None

    def forget(self, node: Node) -> None:
        self._leaves.discard(node)
        self._stamp.pop(node, None)

    def __len__(self) -> int:
        return len(self._leaves)


class AdmissionPolicy(ABC):
    """Decides whether a page that reached one tier is worth copying to the next one down."""

    name: str = ""

    @abstractmethod
    def admit(self, node: Node, hits: int) -> bool:
        """True to copy ``node`` down; ``hits`` is how often the node has been used."""


class AdmitAll(AdmissionPolicy):
    """Copy every page down (``write_through``)."""

    name = "all"

    def admit(self, node: Node, hits: int) -> bool:
        return True


class AdmitOnSecondHit(AdmissionPolicy):
    """Copy a page down once it has been used twice (``write_through_selective``)."""

    name = "second_hit"

    def admit(self, node: Node, hits: int) -> bool:
        return hits >= 2


#: name -> "module:Class". ``kvtier.index.policies`` adds its policies here at import.
EVICTION_POLICIES: dict[str, str] = {"lru": "kvtier.index.eviction:LRUPolicy"}


def make_eviction_policy(name: str, **options: Any) -> EvictionPolicy:
    """A new policy instance by registered name (one instance per tier)."""
    try:
        importlib.import_module("kvtier.index.policies")
    except ImportError:
        pass
    if name not in EVICTION_POLICIES:
        from kvtier.errors import ConfigError

        raise ConfigError("eviction policy", name, ", ".join(sorted(EVICTION_POLICIES)))
    module, _, cls = EVICTION_POLICIES[name].partition(":")
    return getattr(importlib.import_module(module), cls)(**options)
