"""Per-run state of the ``shadow`` policy and the heap its evictable leaves are ranked in.

Owns ``Run`` (what ``kvtier.index.policy_shadow`` remembers about one node) and ``RunHeap``
(that tier's evictable leaves, lowest key first). A run holds the heap entry it is ranked by
while it is an evictable leaf (``entry``, None otherwise), and each entry carries its run, so
membership, re-ranking, removal and the victim's lookup cost no hashing at all: the policy's
one dict from node to run is the only table per call (a shared ``LeafHeap`` keeps two more).
Lazy deletion: re-ranking pushes a new entry and the old one goes stale; stale entries are
skipped when popped and dropped when the heap holds more than twice the live leaves. Ties go to
the entry pushed first. Engine thread only; no locking, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from heapq import heappop, heappush
from typing import Any


class Run:
    """What the policy remembers about one node."""

    __slots__ = ("klass", "last_use", "born", "hits", "pages", "sample", "first", "boost",
                 "dead", "entry")

    def __init__(self, klass: int, last_use: float, born: float, hits: int, pages: int,
                 first: bytes | None = None, boost: float = 0.0) -> None:
        self.klass = klass              # how often the run came back: 0 .. CLASSES - 1
        self.last_use = last_use
        self.born = born
        self.hits = hits                # the node's ``hits`` when last counted
        self.pages = pages
        self.sample: Sequence[bytes] | None = None  # its sampled pages (None: not yet picked)
        self.first = first              # the first page's identity (the key of its ghost)
        self.boost = boost              # a cache hint's head start, in pages of new content
        self.dead = False               # the unused back part of a split run
        self.entry: list[Any] | None = None  # its live heap entry while an evictable leaf


class RunHeap:
    """Evictable leaves ordered by the key their policy gives them: lowest key first."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._seq = itertools.count()
        self.leaves = 0

    def push(self, node: Hashable, run: Run, key: float) -> None:
        """Rank ``node`` (of ``run``) as an evictable leaf by ``key`` (replacing any earlier
        key)."""
        if run.entry is None:
            self.leaves += 1
        run.entry = entry = [key, next(self._seq), node, run]
        heap = self._heap
        heappush(heap, entry)
        if len(heap) > 2 * self.leaves + 64:
            self._heap = [e for e in heap if e[3].entry is e]
            heapq.heapify(self._heap)

    def discard(self, run: Run) -> None:
        """The run's node stopped being an evictable leaf."""
        if run.entry is not None:
            run.entry = None
            self.leaves -= 1

    def pop(self) -> tuple[Hashable, Run] | None:
        """Remove and return the leaf with the lowest key and its run, or None."""
        heap = self._heap
        while heap:
            entry = heappop(heap)
            run = entry[3]
            if run.entry is entry:
                run.entry = None
                self.leaves -= 1
                return entry[2], run
        return None

    def rekey(self, key: Callable[[Run], float]) -> None:
        """Give every live leaf the key ``key(run)`` (O(n): a heap built anew)."""
        live = [e for e in self._heap if e[3].entry is e]
        for entry in live:
            entry[0] = key(entry[3])
        heapq.heapify(live)
        self._heap = live

    def __len__(self) -> int:
        return self.leaves
