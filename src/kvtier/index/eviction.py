"""Eviction and admission policy interfaces, and the LRU reference policy.

Owns the small contract between the radix index and the policies that decide what a tier keeps:
the index tells a tier's ``EvictionPolicy`` which nodes are evictable leaves *of that tier*
(``add``/``remove``), which nodes were used (``touch``), and which left the index for good
(``forget``); when the tier needs room it asks ``pop_victim``. Policies hold node references
only as opaque hashable objects, plus whatever history they keep (bounded). An
``AdmissionPolicy`` decides whether a page is worth copying down to a lower tier at all.
Everything here runs on the engine thread; no locking, no torch. Policies beyond LRU live in
``kvtier.index.policies`` and are looked up by name with ``make_eviction_policy``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import OrderedDict
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
    """Least recently used leaf first: the reference every other policy is measured against."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Node, None] = OrderedDict()

    def add(self, node: Node, pages: int) -> None:
        self._order[node] = None
        self._order.move_to_end(node)

    def remove(self, node: Node) -> None:
        self._order.pop(node, None)

    def touch(self, node: Node) -> None:
        if node in self._order:
            self._order.move_to_end(node)

    def pop_victim(self) -> Node | None:
        if not self._order:
            return None
        node, _ = self._order.popitem(last=False)
        return node

    def __len__(self) -> int:
        return len(self._order)


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
