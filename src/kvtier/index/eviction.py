"""Eviction and admission policy interfaces, and the LRU reference policy.

Owns the small contract between the radix index and the policies that decide what a tier keeps:
the index tells a tier's ``EvictionPolicy`` which nodes are evictable leaves *of that tier*
(``add``/``remove``), which nodes were used (``touch``), and which left the index for good
(``forget``); when the tier needs room it asks ``pop_victim``. Policies hold node references
only as opaque hashable objects, plus whatever history they keep (bounded); the one thing a
policy may read from a node is an integer ``hits`` attribute when the node has one (the radix
index's count of requests that used it), with ``getattr(node, "hits", None)``. An
``AdmissionPolicy`` decides whether a page is worth copying down to a lower tier at all.
Everything here runs on the engine thread; no locking, no torch. ``EVICTION_POLICIES`` lists
every policy by name (the other policies live in their own modules, imported when first made
by ``make_eviction_policy``).
"""

from __future__ import annotations

import heapq
import importlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence

from kvtier.keys import KEY_BYTES

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

    #: True when ``boost`` takes effect (a cache hint can only be honoured by such a policy).
    supports_boost: bool = False

    def boost(self, node: Node, pages: float) -> None:  # noqa: B027 - optional hook
        """A soft hint: rank ``node`` as if it had been used ``pages`` pages of new content
        later than it was (0 clears it). Never a pin: enough new content outlives any boost.
        Policies without ``supports_boost`` ignore it."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable leaves the policy holds."""


class LeafHeap:
    """A tier's evictable leaves ordered by a key the policy computes: lowest key goes first.

    Lazy deletion keeps every operation O(log n): ``push`` adds an entry with the node's new key,
    older entries of that node go stale, and stale entries are skipped when popped or dropped
    when the heap is rebuilt (once it holds more than twice the live leaves). Ties go to the
    node pushed first. Shared by every heap-ranked policy.
    """

    def __init__(self) -> None:
        self._key: dict[Node, float] = {}
        self._leaves: set[Node] = set()
        self._heap: list[tuple[float, int, Node]] = []
        self._seq = itertools.count()

    def push(self, node: Node, key: float) -> None:
        """Make ``node`` an evictable leaf ranked by ``key`` (replacing any earlier key)."""
        self._leaves.add(node)
        self._key[node] = key
        heapq.heappush(self._heap, (key, next(self._seq), node))
        if len(self._heap) > 2 * len(self._leaves) + 64:
            self._heap = [(self._key[n], next(self._seq), n) for n in self._leaves]
            heapq.heapify(self._heap)

    def discard(self, node: Node) -> None:
        """``node`` is no longer an evictable leaf (its key is kept for a later ``push``)."""
        self._leaves.discard(node)

    def forget(self, node: Node) -> None:
        self._leaves.discard(node)
        self._key.pop(node, None)

    def pop_min(self) -> Node | None:
        """Remove and return the leaf with the lowest key, or None."""
        while self._heap:
            key, _, node = heapq.heappop(self._heap)
            if node in self._leaves and self._key.get(node) == key:
                self._leaves.discard(node)
                return node
        return None

    def peek_min(self) -> tuple[float, Node] | None:
        """The lowest key and its leaf, left in place (None when empty); stale entries on top
        are dropped on the way."""
        heap = self._heap
        while heap:
            key, _, node = heap[0]
            if node in self._leaves and self._key.get(node) == key:
                return key, node
            heapq.heappop(heap)
        return None

    def __contains__(self, node: Node) -> bool:
        return node in self._leaves

    def nodes(self) -> list[Node]:
        """The evictable leaves, in no particular order (a copy)."""
        return list(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)


class LRUPolicy(EvictionPolicy):
    """Least recently used leaf first: the reference every other policy is measured against.

    Leaves are ordered by their last ``touch``, not by when they became leaves: a parent exposed
    by its child's eviction was used no later than that child, so it is next in line, not the
    most recent. (Ordering by ``add`` time spreads evictions one page at a time over every path
    and serves visibly less on real traces.)
    """

    name = "lru"

    def __init__(self) -> None:
        self._clock = 0
        self._stamp: dict[Node, int] = {}
        self._leaves = LeafHeap()

    def add(self, node: Node, pages: int) -> None:
        if node not in self._stamp:
            self._clock += 1
            self._stamp[node] = self._clock
        self._leaves.push(node, self._stamp[node])

    def remove(self, node: Node) -> None:
        self._leaves.discard(node)

    def touch(self, node: Node) -> None:
        self._clock += 1
        self._stamp[node] = self._clock
        if node in self._leaves:
            self._leaves.push(node, self._clock)

    def pop_victim(self) -> Node | None:
        return self._leaves.pop_min()

    def forget(self, node: Node) -> None:
        self._leaves.forget(node)
        self._stamp.pop(node, None)

    def __len__(self) -> int:
        return len(self._leaves)


class AdmissionPolicy(ABC):
    """Decides whether a page that reached one tier is worth copying to the next one down."""

    name: str = ""

    @abstractmethod
    def admit(self, node: Node, hits: int) -> bool:
        """True to copy ``node`` down; ``hits`` is how often the node has been used."""

    def admitted_pages(self, path: Sequence[tuple[Node, int]], limit: int,
                       observe: bool = True) -> int:
        """Pages from the root of one request's matched ``path`` ((node, pages used) pairs) to
        copy down, at most ``limit``: up to the first node ``admit`` refuses (a lower tier
        holds a prefix contiguous from the root). ``observe``: this call is the request's one
        sighting (its commit); False asks without recording (its load, before the commit)."""
        pos = 0
        for node, used in path:
            if pos + used > limit or not self.admit(node, getattr(node, "hits", 1)):
                break
            pos += used
        return min(pos, limit)

    def stats(self) -> dict[str, object]:
        """What the policy measured (empty for policies that measure nothing)."""
        return {}


class AdmitAll(AdmissionPolicy):
    """Copy every page down (``write_through``)."""

    name = "all"

    def admit(self, node: Node, hits: int) -> bool:
        return True


def page_layout(node: Node) -> tuple[bytes, int]:
    """The bytes that name ``node``'s pages and how many bytes name one: its page keys when it
    has them, else its token bytes (``b"", 0`` for opaque nodes)."""
    try:
        pages, keys, tokens = node.pages, node.keys, node.tokens  # type: ignore[attr-defined]
    except AttributeError:  # a stand-in node may lack some of them
        pages = getattr(node, "pages", 0)
        keys, tokens = getattr(node, "keys", None), getattr(node, "tokens", None)
    if not pages:
        return b"", 0
    if keys and len(keys) == pages * KEY_BYTES:
        return keys, KEY_BYTES
    if not tokens:
        return b"", 0
    return tokens, len(tokens) // pages


#: Every eviction policy by name -> "module:Class", imported when first made (the one list:
#: modules register nothing themselves).
EVICTION_POLICIES: dict[str, str] = {
    "lru": "kvtier.index.eviction:LRUPolicy",
    "lrfu": "kvtier.index.policies:LRFUPolicy",
    "reuse": "kvtier.index.policy_reuse:ReuseClassPolicy",
    "retention": "kvtier.index.policy_retention:RetentionPolicy",
    "shadow": "kvtier.index.policy_shadow:ShadowPolicy",
}


def make_eviction_policy(name: str, **options: object) -> EvictionPolicy:
    """A new policy instance by registered name (one instance per tier)."""
    if name not in EVICTION_POLICIES:
        from kvtier.errors import ConfigError

        raise ConfigError("eviction policy", name, ", ".join(sorted(EVICTION_POLICIES)))
    module, _, cls = EVICTION_POLICIES[name].partition(":")
    factory: Callable[..., EvictionPolicy] = getattr(importlib.import_module(module), cls)
    return factory(**options)
